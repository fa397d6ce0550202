"""Bad input is reported by the command line before any training starts."""

import subprocess
import sys

from .conftest import ROOT


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "alignflow.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_bad_config_value_exits_2_naming_the_field(tmp_path):
    proc = run("stage", "sft", "--config", "configs/tiny.yaml", "--set", "sft.optim.lr=-1")
    assert proc.returncode == 2
    assert "--set sft.optim.lr=-1: sft.optim.lr: Input should be greater than 0 (got -1" in proc.stderr


def test_bad_data_row_exits_2_naming_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n{"prompt": "2+2"}\n')
    proc = run("stage", "sft", "--config", "configs/tiny.yaml", "--set", f"sft.data.path={data}", "--set", f"storage.root={tmp_path}")
    assert proc.returncode == 2
    assert f"{data}:2: missing key 'response'" in proc.stderr
    assert '"step"' not in proc.stdout and not (tmp_path / "sft").exists()


def test_too_few_rows_for_one_batch(tmp_path):
    data = tmp_path / "small.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n' * 3)
    proc = run("stage", "sft", "--config", "configs/tiny.yaml", "--set", f"sft.data.path={data}", "--set", f"storage.root={tmp_path}")
    assert proc.returncode == 2 and "1 training rows after packing are fewer than batch.global_batch_size=32" in proc.stderr


def test_a_folder_of_data_files_exits_2_at_load(tmp_path):
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text('{"prompt": "1+1", "response": "2"}\n')
    proc = run("stage", "sft", "--config", "configs/tiny.yaml", "--set", f"sft.data.path={tmp_path / 'rows'}")
    assert proc.returncode == 2 and "sft.data.path:" in proc.stderr and "is a folder; give one data file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_too_many_skipped_rows_exit_2_with_the_counts(tmp_path):
    data = tmp_path / "half.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n{"prompt": "2+2"}\n\n' * 40)
    proc = run("stage", "sft", "--config", "configs/tiny.yaml", "--set", f"sft.data.path={data}", "--set", "sft.data.on_bad_row=skip",
               "--set", f"storage.root={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"{data}: 40 of 80 rows skipped (50.0%), more than sft.data.max_skip_fraction=0.05 (120 rows read, 40 used, "
            "80 skipped (missing key 'response': 40; blank line: 40))") in proc.stderr
    assert not (tmp_path / "sft").exists()


def test_version():
    from alignflow import __version__

    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"alignflow {__version__}"

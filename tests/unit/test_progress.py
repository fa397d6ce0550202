"""The progress line a stage prints while it trains."""


def test_progress_line_has_step_eta_and_headline_figures_to_4_digits(capsys, monkeypatch):
    from alignflow.stages.common import progress

    record = {"step": 25, "train/loss": 1.23456789, "train/lr": 0.0029961, "train/tokens_per_s": 12345.678, "train/grad_norm": 3.3}
    assert progress.progress_line(25, 290, 0.21, record, "train/tokens_per_s") == \
        "step 25/290 (8.6%), ETA 0m56s: loss=1.235 lr=0.002996 tokens_per_s=1.235e+04"
    clock = iter([0.0, 4.0, 15.0, 16.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = progress.MetricsLog(True, 100, False, "tokens_per_s")
    log.log(1, {"loss": 2.0}, echo=False)  # 4 s after the start: not yet
    log.log(2, {"loss": 1.5}, echo=False)  # 15 s: a line, with the pace so far (7.5 s a step)
    log.log(3, {"loss": 1.25}, echo=False)  # 1 s after the last line: not yet
    assert capsys.readouterr().out == "step 2/100 (2.0%), ETA 12m15s: loss=1.5\n"


def test_a_training_steps_ungrouped_figures_go_under_train():
    from alignflow.stages.common.progress import MetricsLog

    log, sunk = MetricsLog(True, 10, False, "pairs_per_s"), []
    log.add_sink(lambda step, metrics: sunk.append((step, metrics)))
    log.log(0, {"eval/loss": 2.0, "eval/rewards/margin": 0.0}, echo=False)
    log.log(1, {"loss": 1.5, "rewards/margin": 0.25, "reward/mean": 0.5, "phase/train_s": 1.0, "train/lr": 0.1}, echo=False)
    grouped = {"train/loss": 1.5, "train/rewards/margin": 0.25, "reward/mean": 0.5, "phase/train_s": 1.0, "train/lr": 0.1}
    assert log.history == [{"step": 0, "eval/loss": 2.0, "eval/rewards/margin": 0.0}, {"step": 1, **grouped}]
    assert sunk[1] == (1, grouped)  # MLflow gets the same names as metrics.json
    assert log.headline == "train/pairs_per_s"

"""alignflow: a workflow-orchestrated alignment pipeline."""

__version__ = "0.1.0"

"""Checkpoint interop: export our drafters to, and import them from, the DeepSpec / vLLM and speculators layouts."""

from dspark.interop.export import export_drafter
from dspark.interop.load import import_drafter, is_exported_dir

__all__ = ["export_drafter", "import_drafter", "is_exported_dir"]

"""MLflow tracking: one store per `paths.root` (sqlite) or a remote `mlflow server`; runs carry flat tags."""

from dspark.tracking.store import (
    TrackingStore,
    git_provenance,
    open_store,
    tracking_uri_for,
)

__all__ = ["TrackingStore", "git_provenance", "open_store", "tracking_uri_for"]

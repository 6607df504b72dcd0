"""Configuration: pydantic settings and the Celery config built from them."""

from config.settings import Settings, model_slug

__all__ = ["Settings", "model_slug"]

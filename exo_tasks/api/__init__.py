"""The HTTP API: a Flask app factory with one blueprint per resource.

The API only talks to Redis (job records, streams, runner states) and sends Celery messages;
it never imports MLX.
"""

from __future__ import annotations

from flask import Flask

from config.settings import Settings
from exo_tasks.api import (
    auth,
    batches,
    errors,
    files,
    health,
    hosts,
    instances,
    jobs,
    metrics,
    openai,
    openapi,
    runners,
)
from exo_tasks.api.context import ApiContext
from exo_tasks.celery_app import ExoCelery


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings()
    app = Flask("exo_tasks")
    # `//v1//jobs` is no route (404 in the error shape), not a 308 with an HTML page and a
    # Location built from whatever Host the client sent.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["exo"] = ApiContext(settings=settings, celery=ExoCelery(settings, role="api"))
    errors.init_app(app)
    auth.init_app(app)
    for blueprint in (health.bp, jobs.bp, runners.bp, hosts.bp, instances.bp, openai.bp):
        app.register_blueprint(blueprint)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(files.bp)
    app.register_blueprint(batches.bp)
    return app

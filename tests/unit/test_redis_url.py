"""redis_url: single-server and Sentinel URLs, kombu's form of them, and errors that name the bad part."""

from __future__ import annotations

import pytest

from services.config import Settings
from services.redis_url import (
    SentinelTarget,
    celery_broker,
    check_redis_url,
    is_sentinel,
    parse_sentinel_url,
    redacted,
)


def test_sentinel_url_with_hosts_master_db_and_passwords():
    target = parse_sentinel_url("redis+sentinel://app:p%40ss@s1:26380,[::1],s3/mymaster/5?sentinel_password=sp")
    assert target == SentinelTarget(sentinels=(("s1", 26380), ("::1", 26379), ("s3", 26379)), master="mymaster",
                                    db=5, username="app", password="p@ss", sentinel_password="sp")
    assert "p@ss" not in target.describe() and "mymaster" in target.describe()


def test_db_defaults_to_zero_and_no_password_is_none():
    target = parse_sentinel_url("redis+sentinel://10.0.0.1:26379/primary")
    assert (target.db, target.password, target.username, target.sentinel_password) == (0, None, None, None)


@pytest.mark.parametrize(("url", "names"), [
    ("redis+sentinel://s1:26379/", "no master name"),
    ("redis+sentinel:///mymaster/0", "no sentinel host"),
    ("redis+sentinel://s1:99999/m", "bad sentinel port '99999'"),
    ("redis+sentinel://s1:abc/m", "bad sentinel port 'abc'"),
    ("redis+sentinel://s1/m/zero", "bad path '/m/zero'"),
    ("redis+sentinel://s1/m/0/x", "bad path"),
    ("redis+sentinel://s1/m?timeout=3", "unknown option(s) timeout"),
    ("http://127.0.0.1:6379/0", "must be a redis://"),
])
def test_bad_urls_are_refused_naming_the_bad_part(url, names):
    with pytest.raises(ValueError) as error:
        check_redis_url(url)
    assert names in str(error.value)


def test_errors_never_show_a_password():
    with pytest.raises(ValueError) as error:
        check_redis_url("redis+sentinel://:secret@s1:1234567/m?sentinel_password=other")
    assert "secret" not in str(error.value) and "other" not in str(error.value)
    assert redacted("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def test_settings_take_every_scheme_and_refuse_others():
    for url in ("redis://h:6379/0", "rediss://h:6380/1", "unix:///tmp/r.sock", "redis+sentinel://s1,s2,s3/m/2"):
        assert Settings(redis_url=url).redis_url == url
    with pytest.raises(ValueError, match="must be a"):
        Settings(redis_url="mysql://h/0")


def test_kombu_gets_one_url_and_every_sentinel_as_an_option_the_backend_alternates():
    """No ';' alternates for kombu: it would cycle through them on errors with its stock transport."""
    broker, backend, options = celery_broker("redis+sentinel://:p%40ss@s1:26380,s2/mymaster/4?sentinel_password=sp")
    assert broker == "sentinel://:p%40ss@s1:26380/4"
    assert backend == "sentinel://:p%40ss@s1:26380/4;sentinel://:p%40ss@s2:26379/4"
    assert options == {"master_name": "mymaster", "sentinels": [["s1", 26380], ["s2", 26379]],
                       "sentinel_kwargs": {"password": "sp"}}
    assert celery_broker("redis://h:6379/0") == ("redis://h:6379/0", "redis://h:6379/0", {})
    assert is_sentinel("redis+sentinel://s/m") and not is_sentinel("redis://h")


def test_celery_app_uses_the_sentinel_transport_for_a_sentinel_url():
    from services.celery_app import create_celery_app
    from services.celery_transport import SENTINEL_TRANSPORT, TRANSPORT

    sentinel = create_celery_app(Settings(redis_url="redis+sentinel://s1,s2/mymaster/3")).conf
    assert sentinel.broker_transport == SENTINEL_TRANSPORT
    assert sentinel.broker_transport_options["master_name"] == "mymaster"
    assert sentinel.broker_transport_options["visibility_timeout"] == 300
    assert sentinel.broker_transport_options["sentinels"] == [["s1", 26379], ["s2", 26379]]
    assert ";" not in sentinel.broker_url
    assert sentinel.result_backend_transport_options == {"master_name": "mymaster"}
    plain = create_celery_app(Settings(redis_url="redis://h:6379/0")).conf
    assert plain.broker_transport == TRANSPORT and "master_name" not in plain.broker_transport_options

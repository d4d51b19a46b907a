"""MySQL and MariaDB URLs: the engine they get, and one line for what is not supported."""

from __future__ import annotations

import pytest

from reconciler.errors import ConfigError
from reconciler.storage.engines import create_engine
from reconciler.storage.mysql import require_supported


@pytest.mark.parametrize("version", ["10.6.0-MariaDB", "10.11.19-MariaDB-0+deb12u1",
                                     "11.4.2-MariaDB", "8.0.36", "8.4.0-commercial"])
def test_servers_with_skip_locked_are_accepted(version: str) -> None:
    """MariaDB 10.6+ and MySQL 8.0+ have SKIP LOCKED: accepted as they are."""
    require_supported(version)


@pytest.mark.parametrize(("version", "named"), [
    ("10.5.23-MariaDB-1:10.5.23+maria~deb11", "MariaDB 10.5"),
    ("10.3.39-MariaDB", "MariaDB 10.3"),
    ("5.7.44-log", "MySQL 5.7"),
])
def test_an_older_server_is_one_line_naming_what_is_supported(version: str,
                                                              named: str) -> None:
    """A server without SKIP LOCKED is refused in one line that names it and the minimums."""
    with pytest.raises(ConfigError) as refused:
        require_supported(version)
    message = str(refused.value)
    assert "\n" not in message
    assert named in message
    assert "MySQL 8.0+" in message
    assert "MariaDB 10.6+" in message


def test_a_database_it_does_not_support_is_one_line_naming_the_supported_ones() -> None:
    """``oracle://`` names the three supported URL forms."""
    with pytest.raises(ConfigError) as refused:
        create_engine("oracle://scott:tiger@db.example/orcl")
    message = str(refused.value)
    assert "\n" not in message
    assert "tiger" not in message
    assert "'oracle'" in message
    for supported in ("sqlite:///", "postgresql+psycopg://", "mysql+pymysql://",
                      "MySQL 8.0+", "MariaDB 10.6+"):
        assert supported in message


def test_a_mysql_url_must_use_pymysql() -> None:
    """Another MySQL driver is refused in one line naming the one to use."""
    with pytest.raises(ConfigError, match=r"mysql\+pymysql://"):
        create_engine("mysql+mysqldb://user@db.example/jobs")


@pytest.mark.parametrize("url", ["mysql+pymysql://user@db.example/jobs",
                                 "mariadb+pymysql://user@db.example/jobs",
                                 "mysql://user@db.example/jobs"])
def test_mysql_and_mariadb_urls_get_one_dialect(url: str) -> None:
    """Every accepted form speaks the ``mysql`` dialect through PyMySQL (no connection is
    made until the engine is used)."""
    engine = create_engine(url)
    assert (engine.dialect.name, engine.dialect.driver) == ("mysql", "pymysql")
    engine.dispose()

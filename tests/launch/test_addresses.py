"""Which hosts count as loopback: only IP literals in 127.0.0.0/8, ::1 and the exact name
"localhost". A name that merely looks like one skips no token or TLS check."""
import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.launch.addresses import is_loopback
from sao_actor_learner.variables.security import check_bind


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "127.255.255.254", "localhost",
                                  "::1", "[::1]"])
def test_loopback_literals(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["127.attacker.example", "127.0.0.1.nip.io", "127.evil",
                                  "localhost.attacker.example", "LOCALHOST.", "128.0.0.1",
                                  "10.0.0.1", "0.0.0.0", "::", "", "example.org", "[127.0.0.1]x"])
def test_names_that_look_like_loopback_are_not(host):
    assert not is_loopback(host)


def test_bind_to_a_lookalike_name_needs_a_token():
    with pytest.raises(ValueError, match="auth token"):
        check_bind("127.attacker.example", auth_token="", what="the variable server")
    check_bind("127.0.0.2", auth_token="", what="the variable server")   # a real loopback


def test_config_treats_a_lookalike_name_as_remote():
    """A variable server bound to a look-alike name needs TLS like any other remote host."""
    with pytest.raises(ConfigError, match="127.attacker.example"):
        SAOConfig(bind_host="127.attacker.example").validate()

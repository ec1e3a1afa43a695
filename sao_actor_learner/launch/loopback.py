"""Keeping servers that bind every interface on loopback (local_mp, a loopback --bind_host).

Reverb 0.14's server takes a port and nothing else: `reverb.Server` calls its C++ `StartServer`,
which listens on "[::]:<port>" (the string is in `reverb/libpybind.so`, with gRPC's fallback to
0.0.0.0), with insecure credentials; no argument, gRPC channel argument or environment
variable chooses the interface. torch.distributed's `TCPStore` (the learner group's store) does
the same whatever host it is given. So with the default `--bind_host=127.0.0.1` anyone who can
reach the machine could still reach the replay port (docs/DESIGN.md section 5).

The fix used here works below both: a 30-line `bind()` interposer (C, `LD_PRELOAD`) that turns a
wildcard bind into a loopback one: 0.0.0.0 -> 127.0.0.1 and :: -> ::ffff:127.0.0.1 (the
IPv4-mapped loopback: gRPC's dual-stack socket then accepts 127.0.0.1 only, which is where every
handle of a loopback program points). Every other bind is passed through unchanged. It is
compiled on first use with the system's C compiler into the user's cache folder and put into
the environment of the nodes of the groups that serve on every interface (`WILDCARD_GROUPS`)
before their interpreter starts (`loopback_group_env`); other nodes do not get it (vLLM servers
and reward workers bind what they are told).

Where it does not apply: a non-loopback --bind_host (multi-host runs need the port reachable:
firewall it, docs/DESIGN.md section 5), local_mt (threads of the launching process) and Ray
(its workers' environments are Ray's). Without a C compiler the program runs as before, with a
warning saying what stays exposed.

Pure standard library.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
from typing import Dict, Mapping, Optional

from sao_actor_learner.launch.addresses import is_loopback

__all__ = ["WILDCARD_GROUPS", "local_mp_guards", "loopback_group_env", "loopback_preload"]

# Groups of the SAO program whose servers bind every interface whatever they are told.
WILDCARD_GROUPS = ("replay", "learner_store")

_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

/* sao_actor_learner/launch/loopback.py: a wildcard bind() binds loopback instead. */
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
  static int (*real_bind)(int, const struct sockaddr *, socklen_t) = 0;
  if (!real_bind)
    real_bind = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "bind");
  if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
    struct sockaddr_in a;
    memcpy(&a, addr, sizeof a);
    if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
  } else if (addr && addr->sa_family == AF_INET6 &&
             len >= (socklen_t)sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 a;
    memcpy(&a, addr, sizeof a);
    if (memcmp(&a.sin6_addr, &in6addr_any, sizeof a.sin6_addr) == 0) {
      static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff,
                                               127, 0, 0, 1};
      memcpy(&a.sin6_addr, mapped, sizeof mapped);
      return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
    }
  }
  return real_bind(fd, addr, len);
}
"""

_logger = logging.getLogger(__name__)
_built: Dict[str, Optional[str]] = {}


def _cache_dir() -> str:
    """<cache>/sao_actor_learner, made private (0700); a fresh private temporary folder instead
    when that one is another user's or open to others (a library loaded into the replay node
    must be this user's alone)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "sao_actor_learner")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.path.isdir(path) \
                and not os.path.islink(path):
            return path
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="sao_loopback-")


def loopback_preload() -> Optional[str]:
    """The path of the compiled interposer (built once per source version and user), or None
    when it cannot be built here (no C compiler; logged once)."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    if digest in _built:
        return _built[digest]
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    try:
        path = os.path.join(_cache_dir(), f"loopback_bind-{digest}.so")
        if not os.path.exists(path):
            with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
                src, out = os.path.join(tmp, "loopback_bind.c"), os.path.join(tmp, "out.so")
                with open(src, "w") as f:
                    f.write(_SOURCE)
                subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", out, src, "-ldl"],
                               check=True, capture_output=True, timeout=120)
                os.replace(out, path)      # atomic: a concurrent build finds a whole file
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _logger.warning(
            "could not build the loopback bind() interposer with %r (%s%s): the replay port (and "
            "a learner group's store) listen on every interface of this machine, "
            "unauthenticated; install a C compiler, or firewall them (docs/DESIGN.md section 5)",
            compiler, e, (": " + detail.decode(errors="replace")[-300:]) if detail else "")
        _built[digest] = None
        return None
    _built[digest] = path
    return path


def loopback_group_env(bind_host: str, group_env: Mapping[str, Mapping[str, str]]
                       ) -> Dict[str, Dict[str, str]]:
    """`group_env` (launch()'s per-group environments) with LD_PRELOAD of the interposer added
    for WILDCARD_GROUPS when `bind_host` is loopback (unchanged otherwise, or when it cannot be
    built). An LD_PRELOAD already in this process's environment is kept after it."""
    out = {g: dict(e) for g, e in group_env.items()}
    if not is_loopback(bind_host):
        return out
    path = loopback_preload()
    if path is None:
        return out
    for group in WILDCARD_GROUPS:
        env = out.setdefault(group, {})
        rest = env.get("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
        env["LD_PRELOAD"] = path + (" " + rest if rest else "")
    return out


def local_mp_guards(launch_type: str, bind_host: str, node_timeout_s: float,
                    options: Mapping[str, object]) -> Dict[str, object]:
    """The launch() options that guard a local_mp program (none under other launchers):
    `node_timeout_s` (heartbeats, liveness.py) and `group_env`, `options`' own (placement)
    with the interposer added (loopback_group_env)."""
    if launch_type != "local_mp":
        return {}
    group_env = options.get("group_env") or {}
    return {"node_timeout_s": node_timeout_s,
            "group_env": loopback_group_env(bind_host, group_env)}   # type: ignore[arg-type]

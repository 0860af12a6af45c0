"""What the tests on the emulated cluster (tools/emulated_cluster.sh) share: whether this machine can host it,
and the script's own commands."""

import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(REPO, "tools", "emulated_cluster.sh")
STATE = "/run/perseus-cluster"
# Lines of emulated_cluster.sh that mean "this machine cannot host the cluster", not "the script is wrong".
CANNOT_BUILD = ("does not work here", "could not install openssh-server", "apt-get is not available",
                "is missing; install it", "is already used on this machine")


def why_not_here():
    """Why the emulated cluster cannot be built on this machine, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: the emulated cluster creates network namespaces and ssh daemons"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing: the emulated cluster needs iproute2, util-linux and openssh-client"
    if not os.path.exists("/usr/sbin/sshd") and shutil.which("apt-get") is None:
        return "no /usr/sbin/sshd and no apt-get to install openssh-server"
    return None


def cluster(*args, timeout=60):
    """Run ``tools/emulated_cluster.sh ARGS``; its CompletedProcess (text output captured)."""
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout)

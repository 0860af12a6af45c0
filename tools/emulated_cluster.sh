#!/usr/bin/env bash
# An emulated cluster on this one machine: several "hosts", each a network namespace with its own hostname,
# its own address, its own ssh server and a shaped link, so that perseusrun and Open MPI launch across them
# exactly as across real machines (ssh, one daemon per host, TCP between hosts, shared memory inside a host).
#
#   tools/emulated_cluster.sh up HOSTS LINK_MBIT FLOW_MBIT [SLOTS]
#       Build HOSTS hosts (1-64) named perseus-h0, perseus-h1, ... Each host's link carries at most LINK_MBIT
#       Mbit/s in each direction, and one TCP connection at most FLOW_MBIT Mbit/s (a cloud network's per-flow
#       cap). LINK_MBIT 0 leaves the links unshaped; FLOW_MBIT 0 leaves flows capped by the link only. SLOTS
#       (or $PERSEUS_CLUSTER_SLOTS; default 2) is the slot count per host written to the hostfile. The last
#       (and only) line on stdout is the hostfile's path; progress goes to stderr:
#           HOSTFILE="$(sudo tools/emulated_cluster.sh up 2 800 200)"
#   tools/emulated_cluster.sh down       remove everything "up" made (also after a crash or a partial "up")
#   tools/emulated_cluster.sh status     hosts, addresses, ssh daemons, queueing disciplines, class counters
#   tools/emulated_cluster.sh shape HOST LINK_MBIT FLOW_MBIT
#       shape one host's link anew (as "up" does for all; LINK_MBIT 0 removes the shaping), so that hosts of one
#       cluster can differ (the tests share one cluster between modules that want shaped and unshaped links)
#   tools/emulated_cluster.sh check [SECONDS [HOST_A HOST_B]]
#       measure TCP throughput between HOST_A and HOST_B (default perseus-h0 and perseus-h1) with 1, 4 and 8
#       concurrent connections, in both directions (default 2 s per measurement, about 20 s in all)
#
# What it builds (all names and addresses are owned by this script; "down" touches nothing else):
#   - a bridge perseus0 in the root namespace with 10.213.0.1/24;
#   - per host i: network namespace perseus-h<i>, a veth pair perseus-v<i> (root side, a bridge port) <->
#     perseus0 (inside the namespace; every host and the root namespace thus reach the cluster network
#     through an interface of the same name, so "--network-interface perseus0" is right everywhere), address
#     10.213.0.<10+i>, loopback up, no default route (traffic cannot leave the cluster's subnet);
#   - per host an sshd (Debian's openssh-server; keys only, through PAM like the system's sshd) listening on
#     the host's address only, started inside the namespace and inside its own UTS namespace whose hostname
#     is perseus-h<i>. Distinct hostnames matter: Open MPI groups processes into nodes by hostname, and hosts
#     sharing the machine's name would be taken for one node (shared-memory transports across namespaces,
#     which crash);
#   - htb shaping on both ends of each veth (the namespace end shapes the host's upload, the root end its
#     download): one parent class at LINK_MBIT, and under it 256 leaf classes with ceil FLOW_MBIT chosen by a
#     two-level u32 hash of both TCP ports (see tc_batch), plus a default class for everything else;
#   - state (keys, sshd configs, pid files, logs, the hostfile) under /run/perseus-cluster;
#   - marked blocks in /etc/hosts (the host names), and in the cluster user's ~/.ssh/authorized_keys (a key
#     made for the cluster) and ~/.ssh/config (so that plain "ssh perseus-h0", as Open MPI runs it, logs in
#     with that key and no prompts). The cluster user is $SUDO_USER when run through sudo, else root.
# Latency is not emulated: this kernel has no netem. See docs/emulated_cluster.md.
set -euo pipefail

STATE=/run/perseus-cluster
NS_PREFIX=perseus-h            # namespaces and host names: perseus-h0, perseus-h1, ...
ROOT_VETH_PREFIX=perseus-v     # root-namespace ends of the veth pairs
NIC=perseus0                   # the bridge in the root namespace, and each host's interface
NET=10.213.0                   # the cluster's /24; the bridge is .1, host i is .(10+i)
HOST_BASE=10
MAX_HOSTS=64
HASH_BITS=6                    # 64 buckets on each port (see tc_batch)
LEAVES=256                     # per-flow classes per device
BEGIN_MARK="# BEGIN perseus emulated cluster (tools/emulated_cluster.sh); removed by 'down'"
END_MARK="# END perseus emulated cluster"
PROG="emulated_cluster.sh"

die() { echo "$PROG: error: $*" >&2; exit 1; }
say() { echo "$PROG: $*" >&2; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces and ssh daemons); run it with sudo"
}

need_tools() {
  local t
  for t in ip tc ssh ssh-keygen unshare awk; do
    command -v "$t" >/dev/null 2>&1 \
      || die "'$t' is missing; install it (Debian: apt-get install iproute2 openssh-client util-linux gawk)"
  done
  ip netns list >/dev/null 2>&1 \
    || die "'ip netns' does not work here (no network namespaces); use a kernel or container that allows them"
}

# The user whose ~/.ssh gets the key and config: the one who ran sudo, else the caller.
cluster_user() {
  if [ -f "$STATE/user" ]; then cat "$STATE/user"; else echo "${SUDO_USER:-$(id -un)}"; fi
}
user_home() { getent passwd "$1" | cut -d: -f6; }

# The state file that says "up" added a newline to the end of FILE (which had none) before its block.
newline_mark() { echo "$STATE/added_newline$(echo "$1" | tr / _)"; }

# Remove our marked block from FILE, editing in place (keeps the file's owner, mode, and a bind mount such as a
# container's /etc/hosts). Prints nothing; a file without the block is left untouched.
remove_block() {
  local file="$1" tmp
  [ -f "$file" ] && grep -qF "$BEGIN_MARK" "$file" || return 0
  tmp="$(mktemp)"
  awk -v b="$BEGIN_MARK" -v e="$END_MARK" '$0 == b {skip = 1; next} skip && $0 == e {skip = 0; next} !skip' \
    "$file" >"$tmp"
  cat "$tmp" >"$file"
  rm -f "$tmp"
  if [ -f "$(newline_mark "$file")" ] && [ -s "$file" ] && [ -z "$(tail -c1 "$file")" ]; then
    truncate -s -1 "$file"
  fi
}

# add_block FILE top|bottom < lines: put the lines between our markers at the top or the bottom of FILE.
add_block() {
  local file="$1" where="$2" tmp
  tmp="$(mktemp)"
  {
    if [ "$where" = bottom ] && [ -s "$file" ]; then
      cat "$file"
      if [ -n "$(tail -c1 "$file")" ]; then echo; touch "$(newline_mark "$file")"; fi
    fi
    echo "$BEGIN_MARK"
    cat
    echo "$END_MARK"
    if [ "$where" = top ] && [ -s "$file" ]; then cat "$file"; fi
  } >"$tmp"
  cat "$tmp" >"$file"
  rm -f "$tmp"
}

# The namespaces this script made (by name), in numeric order.
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}[0-9]+$" | sort -t h -k 2 -n || true
}

# ----------------------------------------------------------------------------------------------------- down

cmd_down() {
  need_root
  local ns pids pid f user home i
  # 1. Processes inside our namespaces: the ssh daemons and whatever was launched through them (MPI daemons
  #    and ranks). A namespace lives on while a process holds it, so they go first: TERM, then KILL.
  for ns in $(our_namespaces); do
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  done
  for f in "$STATE"/h*/sshd.pid; do  # an sshd whose namespace is already gone (interrupted "down")
    [ -f "$f" ] || continue
    pid="$(cat "$f" 2>/dev/null || true)"
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = sshd ]; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for i in 1 2 3 4 5 6 7 8 9 10; do
    pids=""
    for ns in $(our_namespaces); do pids="$pids $(ip netns pids "$ns" 2>/dev/null || true)"; done
    [ -n "${pids// /}" ] || break
    if [ "$i" = 10 ]; then kill -KILL $pids 2>/dev/null || true; sleep 0.2; else sleep 0.2; fi
  done
  # 2. Namespaces (deleting one destroys the veth end inside it, and with it the pair), then any root-side
  #    veth end or bridge left over.
  for ns in $(our_namespaces); do ip netns del "$ns" 2>/dev/null || true; done
  for f in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 \
             | grep -E "^${ROOT_VETH_PREFIX}[0-9]+$" || true); do
    ip link del "$f" 2>/dev/null || true
  done
  if ip -d link show "$NIC" 2>/dev/null | grep -q "bridge "; then
    ip link del "$NIC" 2>/dev/null || true
  fi
  # 3. Marked blocks: host names, the key in authorized_keys, the ssh client settings.
  remove_block /etc/hosts
  user="$(cluster_user)"
  home="$(user_home "$user")"
  if [ -n "$home" ]; then
    for f in "$home/.ssh/authorized_keys" "$home/.ssh/config"; do
      remove_block "$f"
      # A file (or ~/.ssh) that "up" created and that is now empty goes too.
      if [ -f "$STATE/created$(echo "$f" | tr / _)" ] && [ -f "$f" ] && [ ! -s "$f" ]; then rm -f "$f"; fi
    done
    if [ -f "$STATE/created_ssh_dir" ]; then rmdir "$home/.ssh" 2>/dev/null || true; fi
  fi
  # 4. The privilege-separation directory, if "up" created it, and the state.
  if [ -f "$STATE/created_run_sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
  rm -rf "$STATE"
}

# ------------------------------------------------------------------------------------------------------ up

# tc_batch DEV LINK_MBIT FLOW_MBIT: the tc commands that shape DEV's egress (see the header).
#
# Per-flow classes: a TCP packet is hashed on bits 1-6 of its source port (table 100:, 64 buckets); each of those
# buckets links to its own table (200:..23f:) hashed on bits 1-6 of the destination port, and bucket (i, j) sends
# the packet to leaf class 1:(100 + (i + 4 j) mod 256). Both ports count because both are ephemeral in MPI jobs
# (listeners bind port 0 too), and the two directions of a flow carry them in opposite fields; the mapping keeps
# connections that share one end (many connections to one listener) apart in 64 classes, and others in 256.
# Bit 0 is skipped: Linux gives connect() ports of one parity (and bind(0) mostly the other).
tc_batch() {
  local dev="$1" link="$2" flow="$3"
  local n=$((1 << HASH_BITS)) i j leaf_kbit link_burst flow_burst q=65536
  # Guaranteed rates of the leaves must sum to no more than the link: a class under its own rate sends
  # without asking its parent, so larger guarantees would let many flows together exceed the link.
  leaf_kbit=$((link * 1000 / (LEAVES + 1)))
  [ "$leaf_kbit" -ge 1 ] || leaf_kbit=1
  # Bursts hold at least two 64 KB GSO packets (veth passes TCP segments of up to 64 KB), or 2 ms at the rate.
  link_burst=$((link * 250 > 131072 ? link * 250 : 131072))
  flow_burst=$((flow * 250 > 131072 ? flow * 250 : 131072))
  # quantum is set explicitly: the default (rate / 10) is far above the kernel's limit at these rates.
  local link_opts="burst $link_burst cburst $link_burst quantum $q"
  echo "qdisc add dev $dev root handle 1: htb default 2"
  echo "class add dev $dev parent 1: classid 1:1 htb rate ${link}mbit ceil ${link}mbit $link_opts"
  echo "class add dev $dev parent 1:1 classid 1:2 htb rate ${leaf_kbit}kbit ceil ${link}mbit $link_opts"
  [ "$flow" -gt 0 ] || return 0
  for ((i = 0; i < LEAVES; i++)); do
    printf 'class add dev %s parent 1:1 classid 1:%x htb rate %skbit ceil %smbit burst %s cburst %s quantum %s\n' \
      "$dev" $((0x100 + i)) "$leaf_kbit" "$flow" "$flow_burst" "$flow_burst" "$q"
  done
  # At offset 20 from the start of an IPv4 header without options lies the TCP header's first word:
  # source port << 16 | destination port.
  local smask dmask
  smask=$(printf '0x%08x' $(((n - 1) << 17)))
  dmask=$(printf '0x%08x' $(((n - 1) << 1)))
  echo "filter add dev $dev parent 1: prio 1 handle 100: protocol ip u32 divisor $n"
  for ((i = 0; i < n; i++)); do
    printf 'filter add dev %s parent 1: prio 1 handle %x: protocol ip u32 divisor %s\n' "$dev" $((0x200 + i)) "$n"
  done
  for ((i = 0; i < n; i++)); do
    printf 'filter add dev %s parent 1: prio 1 protocol ip u32 ht 100:%x: match u32 0 0 link %x: %s\n' \
      "$dev" "$i" $((0x200 + i)) "hashkey mask $dmask at 20"
    for ((j = 0; j < n; j++)); do
      printf 'filter add dev %s parent 1: prio 1 protocol ip u32 ht %x:%x: match u32 0 0 flowid 1:%x\n' \
        "$dev" $((0x200 + i)) "$j" $((0x100 + (i + 4 * j) % LEAVES))
    done
  done
  # Entry: TCP goes to the source-port table; anything else falls through to the default class 1:2.
  echo "filter add dev $dev parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff" \
       "link 100: hashkey mask $smask at 20"
}

# shape NETNS|- DEV LINK FLOW
shape() {
  local ns="$1" dev="$2" file
  file="$STATE/tc-${ns//-/_}-$dev.batch"
  tc_batch "$dev" "$3" "$4" >"$file"
  local netns=()
  [ "$ns" = - ] || netns=(-n "$ns")
  tc "${netns[@]}" -batch "$file" >"$file.log" 2>&1 \
    || die "tc failed to shape $dev${netns:+ in $ns}: $(grep -v '^$' "$file.log" | head -1);" \
           "$(tail -1 "$file.log") (does this kernel have htb and u32?)"
}

# shape_host I LINK FLOW: host I's upload (its end of the veth) and download (the root end) shaped to LINK/FLOW
# Mbit/s, or unshaped when LINK is 0; an earlier shaping is removed first. Remembered in $STATE/h<I>/shape.
shape_host() {
  local i="$1" link="$2" flow="$3" ns="${NS_PREFIX}$1" rv="${ROOT_VETH_PREFIX}$1"
  tc -n "$ns" qdisc del dev "$NIC" root 2>/dev/null || true
  tc qdisc del dev "$rv" root 2>/dev/null || true
  if [ "$link" -gt 0 ]; then
    shape "$ns" "$NIC" "$link" "$flow"   # upload
    shape - "$rv" "$link" "$flow"         # download
  fi
  mkdir -m 700 -p "$STATE/h$i"
  echo "$link $flow" >"$STATE/h$i/shape"
}

# check_rates LINK FLOW: exit (with the usage) unless LINK and FLOW are valid shaping rates.
check_rates() {
  local link="$1" flow="$2"
  if [ "$link" = 0 ] && [ "$flow" != 0 ]; then
    die "FLOW_MBIT needs a shaped link; give LINK_MBIT > 0, or FLOW_MBIT 0"
  fi
  [ "$link" -le 100000 ] || die "LINK_MBIT must be at most 100000 (100 Gbit/s), got $link"
  [ "$flow" -le "$link" ] || die "FLOW_MBIT ($flow) exceeds LINK_MBIT ($link); a flow cannot be faster than its link"
}

# host_index NAME: the index of host NAME (perseus-h<I>, or I itself) of the running cluster; exits if none.
host_index() {
  local name="$1" hosts i
  [ -f "$STATE/params" ] || die "no emulated cluster; bring one up with '$PROG up 2 800 200'"
  read -r hosts _ <"$STATE/params"
  i="${name#"$NS_PREFIX"}"
  [[ "$i" =~ ^[0-9]+$ ]] && [ $((10#$i)) -lt "$hosts" ] \
    || die "'$name' is not a host of this cluster (${NS_PREFIX}0..${NS_PREFIX}$((hosts - 1)))"
  echo $((10#$i))
}

ensure_sshd() {
  [ -x /usr/sbin/sshd ] && return 0
  command -v apt-get >/dev/null 2>&1 \
    || die "/usr/sbin/sshd is missing and apt-get is not available; install an OpenSSH server"
  say "installing openssh-server (its system service is not started)"
  # policy-rc.d keeps the package's post-install script from starting the system's ssh service.
  local policy=/usr/sbin/policy-rc.d made_policy=""
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; made_policy=1; fi
  local ok=1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >"$STATE/apt.log" 2>&1 \
    || { apt-get update -q >>"$STATE/apt.log" 2>&1 \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server >>"$STATE/apt.log" 2>&1; } || ok=0
  [ -z "$made_policy" ] || rm -f "$policy"
  [ "$ok" = 1 ] && [ -x /usr/sbin/sshd ] \
    || die "could not install openssh-server with apt-get (log: $STATE/apt.log); install it by hand"
}

host_addr() { echo "$NET.$((HOST_BASE + $1))"; }

start_host() {  # start_host I LINK FLOW
  local i="$1" link="$2" flow="$3" ns="${NS_PREFIX}$1" rv="${ROOT_VETH_PREFIX}$1" dir="$STATE/h$1" addr
  addr="$(host_addr "$i")"
  mkdir -m 700 -p "$dir"
  ip netns add "$ns"
  # The namespace end is created under a temporary name: the root namespace already has an interface perseus0.
  ip link add "$rv" type veth peer name "perseus-n$i"
  ip link set "perseus-n$i" netns "$ns"
  ip -n "$ns" link set "perseus-n$i" name "$NIC"
  ip link set "$rv" master "$NIC"
  sysctl -qw "net.ipv6.conf.$rv.disable_ipv6=1" 2>/dev/null || true
  ip link set "$rv" up
  ip netns exec "$ns" sysctl -qw "net.ipv6.conf.$NIC.disable_ipv6=1" 2>/dev/null || true
  ip -n "$ns" addr add "$addr/24" dev "$NIC"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "$NIC" up
  shape_host "$i" "$link" "$flow"
  ssh-keygen -q -t ed25519 -N '' -C "$ns host key" -f "$dir/ssh_host_ed25519_key"
  cat >"$dir/sshd_config" <<EOF
# sshd of the emulated host $ns (tools/emulated_cluster.sh)
ListenAddress $addr
Port 22
HostKey $dir/ssh_host_ed25519_key
PidFile $dir/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM yes
UseDNS no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 64:30:128
MaxSessions 64
EOF
  /usr/sbin/sshd -t -f "$dir/sshd_config" 2>"$dir/sshd.log" \
    || die "sshd rejects $dir/sshd_config: $(tail -1 "$dir/sshd.log")"
  # The hostname is set in a new UTS namespace, then sshd replaces the shell; it forks into the background
  # and every login (and everything Open MPI starts through it) inherits both namespaces.
  ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$1" && exec /usr/sbin/sshd -f "$2" -E "$3"' \
    sh "$ns" "$dir/sshd_config" "$dir/sshd.log" \
    || die "sshd did not start in $ns (its log: $(tail -1 "$dir/sshd.log"))"
  echo "$ns $addr" >>"$STATE/hosts"
}

wait_listening() {  # wait_listening I: until the host's sshd accepts connections (5 s)
  local ns="${NS_PREFIX}$1" addr k
  addr="$(host_addr "$1")"
  for ((k = 0; k < 50; k++)); do
    if ip netns exec "$ns" timeout 1 bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  die "sshd of $ns does not accept connections on $addr:22 (its log: $(tail -1 "$STATE/h$1/sshd.log"))"
}

cmd_up() {
  need_root
  [ $# -ge 3 ] && [ $# -le 4 ] || die "usage: $PROG up HOSTS LINK_MBIT FLOW_MBIT [SLOTS], e.g. $PROG up 2 800 200"
  local hosts="$1" link="$2" flow="$3" slots="${4:-${PERSEUS_CLUSTER_SLOTS:-2}}" v
  for v in "$hosts" "$link" "$flow" "$slots"; do
    [[ "$v" =~ ^[0-9]+$ ]] \
      || die "'$v' is not a non-negative integer; usage: $PROG up HOSTS LINK_MBIT FLOW_MBIT [SLOTS]"
  done
  hosts=$((10#$hosts)); link=$((10#$link)); flow=$((10#$flow)); slots=$((10#$slots))
  [ "$hosts" -ge 1 ] && [ "$hosts" -le "$MAX_HOSTS" ] || die "HOSTS must be 1 to $MAX_HOSTS, got $hosts"
  [ "$slots" -ge 1 ] || die "SLOTS must be at least 1, got $slots"
  check_rates "$link" "$flow"
  need_tools
  # Leftovers of an earlier run (ours only, found by name and marker) go first: "up" can be repeated.
  cmd_down
  local taken
  taken="$(ip -4 -o addr show to "$NET.0/24" 2>/dev/null | awk '{print $2}' | head -1)"
  [ -z "$taken" ] || die "the subnet $NET.0/24 is already used on this machine (by $taken); free it first"
  local user home
  user="${SUDO_USER:-$(id -un)}"
  home="$(user_home "$user")"
  [ -n "$home" ] && [ -d "$home" ] || die "cannot find the home directory of user '$user'"
  # Anything that fails from here on leaves a partial cluster: take it down again.
  UP_DONE=0
  trap 'if [ "$UP_DONE" != 1 ]; then say "up did not finish; removing what it made"; cmd_down; fi' EXIT
  mkdir -m 755 -p "$STATE"
  echo "$user" >"$STATE/user"
  echo "$hosts $link $flow $slots" >"$STATE/params"
  ensure_sshd
  if [ ! -d /run/sshd ]; then mkdir -m 755 /run/sshd; touch "$STATE/created_run_sshd"; fi
  # The client key: readable by the cluster user only.
  mkdir -m 700 "$STATE/ssh"
  ssh-keygen -q -t ed25519 -N '' -C "perseus emulated cluster" -f "$STATE/ssh/id_ed25519"
  chown -R "$user:" "$STATE/ssh"

  ip link add "$NIC" type bridge
  sysctl -qw "net.ipv6.conf.$NIC.disable_ipv6=1" 2>/dev/null || true
  ip addr add "$NET.1/24" dev "$NIC"
  ip link set "$NIC" up
  : >"$STATE/hosts"
  local i
  for ((i = 0; i < hosts; i++)); do start_host "$i" "$link" "$flow"; done

  # Names, key and client settings.
  { for ((i = 0; i < hosts; i++)); do echo "$(host_addr "$i") ${NS_PREFIX}$i"; done; } | add_block /etc/hosts bottom
  local f
  if [ ! -d "$home/.ssh" ]; then
    mkdir -m 700 "$home/.ssh"; chown "$user:" "$home/.ssh"; touch "$STATE/created_ssh_dir"
  fi
  for f in "$home/.ssh/authorized_keys" "$home/.ssh/config"; do
    if [ ! -e "$f" ]; then
      install -m 600 -o "$user" /dev/null "$f"
      touch "$STATE/created$(echo "$f" | tr / _)"
    fi
  done
  add_block "$home/.ssh/authorized_keys" bottom <"$STATE/ssh/id_ed25519.pub"
  # At the top: ssh takes the first value it finds for an option. The closing "Host *" hands whatever follows
  # back to every host, as it was before the block was added.
  add_block "$home/.ssh/config" top <<EOF
Host ${NS_PREFIX}* $NET.*
    IdentityFile $STATE/ssh/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 5
Host *
EOF

  for ((i = 0; i < hosts; i++)); do echo "${NS_PREFIX}$i slots=$slots" ; done >"$STATE/hostfile"
  chmod 644 "$STATE/hostfile" "$STATE/hosts"
  for ((i = 0; i < hosts; i++)); do wait_listening "$i"; done
  # Log in to every host as the cluster user, as Open MPI will, and check that it answers with its own name.
  local got
  for ((i = 0; i < hosts; i++)); do
    got="$(runuser -u "$user" -- ssh "${NS_PREFIX}$i" hostname 2>"$STATE/ssh-check.err" </dev/null || true)"
    # The state, logs included, is removed on failure: the message carries the last lines of both sides.
    [ "$got" = "${NS_PREFIX}$i" ] || die "'ssh ${NS_PREFIX}$i hostname' as $user answered '$got'" \
      "(ssh: $(tail -1 "$STATE/ssh-check.err"); sshd: $(tail -1 "$STATE/h$i/sshd.log"))"
  done
  UP_DONE=1
  local shaping="unshaped" per_flow="no per-flow cap"
  [ "$flow" = 0 ] || per_flow="${flow} Mbit/s per TCP flow"
  [ "$link" = 0 ] || shaping="links ${link} Mbit/s per direction, $per_flow"
  say "up: $hosts hosts (${NS_PREFIX}0..${NS_PREFIX}$((hosts - 1)), $NET.$HOST_BASE-$((HOST_BASE + hosts - 1)))," \
      "$shaping, $slots slots each; ssh as $user"
  echo "$STATE/hostfile"
}

# -------------------------------------------------------------------------------------------------- status

# class_summary NETNS|- DEV: the classes of DEV that carried traffic, one per line.
class_summary() {
  local netns=()
  [ "$1" = - ] || netns=(-n "$1")
  tc "${netns[@]}" -s class show dev "$2" | awk '
    /^class htb/ { id = $3; rate = ""; ceil = ""
                   for (k = 1; k <= NF; k++) { if ($k == "rate") rate = $(k+1); if ($k == "ceil") ceil = $(k+1) } }
    /^ Sent/     { if ($2 > 0 && id != "")
                     printf "      class %-6s rate %-9s ceil %-9s sent %12d bytes %9d pkts\n", id, rate, ceil, $2, $4
                   id = "" }'
}

cmd_status() {
  need_root
  if [ ! -f "$STATE/hosts" ]; then
    echo "no emulated cluster (no $STATE/hosts)"
    local left; left="$(our_namespaces | tr '\n' ' ')"
    [ -z "$left" ] || echo "leftover namespaces: $left (run '$PROG down')"
    return 0
  fi
  local hosts link flow slots
  read -r hosts link flow slots <"$STATE/params"
  echo "cluster: $hosts hosts, brought up with link ${link} Mbit/s, flow ${flow} Mbit/s (0: not shaped), $slots slots;" \
       "hostfile $STATE/hostfile"
  echo "bridge $NIC: $(ip -4 -o addr show dev "$NIC" 2>/dev/null | awk '{print $4}')" \
       "$(cat "/sys/class/net/$NIC/operstate" 2>/dev/null || echo missing)"
  local ns addr i pid alive name rv
  i=0
  while read -r ns addr; do
    rv="${ROOT_VETH_PREFIX}$i"
    pid="$(cat "$STATE/h$i/sshd.pid" 2>/dev/null || echo "")"
    alive="not running"
    name="?"
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = sshd ]; then
      alive="pid $pid"
      name="$(nsenter -t "$pid" -u hostname 2>/dev/null || echo "?")"
    fi
    echo "$ns: address $addr, hostname $name, sshd $alive, shaped $(cat "$STATE/h$i/shape" 2>/dev/null || echo "?")" \
         "(link, flow Mbit/s; 0: not shaped)"
    echo "  upload ($NIC in $ns): $(tc -n "$ns" qdisc show dev "$NIC" 2>/dev/null | head -1)"
    echo "    tx $(cat "/sys/class/net/$rv/statistics/rx_bytes" 2>/dev/null || echo "?") bytes"
    class_summary "$ns" "$NIC" 2>/dev/null || true
    echo "  download ($rv): $(tc qdisc show dev "$rv" 2>/dev/null | head -1)"
    echo "    tx $(cat "/sys/class/net/$rv/statistics/tx_bytes" 2>/dev/null || echo "?") bytes"
    class_summary - "$rv" 2>/dev/null || true
    i=$((i + 1))
  done <"$STATE/hosts"
}

# --------------------------------------------------------------------------------------------------- check

# The throughput probe. "listen ADDR PORT N SECS WHO" accepts N connections on ADDR:PORT; "connect ADDR PORT N SECS
# WHO" opens N connections to it. WHO says which side sends ("connector" or "listener"); the other side receives,
# measures each connection over SECS seconds after a 1 s warm-up, prints one line, and closes the connections,
# which ends the sender.
CHECK_PY='
import socket, sys, threading, time
role, addr, who = sys.argv[1], sys.argv[2], sys.argv[6]
port, n, secs = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
if role == "listen":
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(n)
    srv.settimeout(10)
    conns = [srv.accept()[0] for _ in range(n)]
else:
    deadline, conns = time.monotonic() + 10, []
    while len(conns) < n:
        try:
            conns.append(socket.create_connection((addr, port), timeout=2))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
for c in conns:
    c.settimeout(secs + 10)
if (role == "connect") == (who == "connector"):
    data = b"\0" * (1 << 18)
    def pump(c):
        try:
            while True:
                c.sendall(data)
        except OSError:
            pass
    threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(secs + 10)
    sys.exit(0)
got = [0] * n
def drain(i):
    buf = bytearray(1 << 20)
    try:
        while True:
            k = conns[i].recv_into(buf)
            if not k:
                return
            got[i] += k
    except OSError:
        return
for i in range(n):
    threading.Thread(target=drain, args=(i,), daemon=True).start()
time.sleep(1.0)
before, t0 = list(got), time.monotonic()
time.sleep(secs)
after, t1 = list(got), time.monotonic()
rates = [(a - b) * 8 / (t1 - t0) / 1e6 for a, b in zip(after, before)]
for c in conns:
    try:
        c.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
print("%d flow%s %7.1f Mbit/s in total; per flow %s" % (n, " " if n == 1 else "s", sum(rates),
      " ".join("%.0f" % r for r in rates)))
'

cmd_check() {
  need_root
  local secs="${1:-2}" a="${2:-${NS_PREFIX}0}" b="${3:-${NS_PREFIX}1}"
  [[ "$secs" =~ ^[0-9]+$ ]] && [ "$secs" -ge 1 ] || die "SECONDS must be a positive integer, got '$secs'"
  [ -f "$STATE/params" ] || die "no emulated cluster; bring one up with '$PROG up 2 800 200'"
  local hosts
  read -r hosts _ <"$STATE/params"
  [ "$hosts" -ge 2 ] || die "check needs at least 2 hosts; this cluster has $hosts"
  local ia ib
  ia="$(host_index "$a")"; ib="$(host_index "$b")"
  a="${NS_PREFIX}$ia"; b="${NS_PREFIX}$ib"
  [ "$ia" != "$ib" ] || die "check needs two different hosts, got $a twice"
  local link flow
  read -r link flow <"$STATE/h$ia/shape"
  local py=/usr/bin/python3 dst n who out lpid port=5201 limit=$((secs + 20))
  [ -x "$py" ] || py="$(command -v python3 || true)"
  [ -n "$py" ] || die "python3 is missing; install it (apt-get install python3)"
  dst="$(host_addr "$ib")"
  echo "TCP throughput between $a and $b, measured over ${secs} s" \
       "($a: link ${link} Mbit/s, per flow ${flow} Mbit/s; 0: not shaped)"
  # Both directions: the hashing must keep flows apart whichever end has the listening port.
  for who in connector listener; do
    if [ "$who" = connector ]; then
      echo "$a -> $b (the sender opened the connections):"
    else
      echo "$b -> $a (the receiver opened the connections):"
    fi
    for n in 1 4 8; do
      out="$(mktemp)"
      ip netns exec "$b" timeout "$limit" "$py" -c "$CHECK_PY" \
        listen "$dst" "$port" "$n" "$secs" "$who" >"$out" 2>&1 &
      lpid=$!
      ip netns exec "$a" timeout "$limit" "$py" -c "$CHECK_PY" \
        connect "$dst" "$port" "$n" "$secs" "$who" >>"$out" 2>&1 \
        || { wait "$lpid" || true; cat "$out" >&2; rm -f "$out"; die "the probe with $n flows failed (above)"; }
      wait "$lpid" || { cat "$out" >&2; rm -f "$out"; die "the probe with $n flows failed (above)"; }
      sed 's/^/  /' "$out"
      rm -f "$out"
      port=$((port + 2))
    done
  done
}

# --------------------------------------------------------------------------------------------------- shape

cmd_shape() {
  need_root
  [ $# -eq 3 ] || die "usage: $PROG shape HOST LINK_MBIT FLOW_MBIT, e.g. $PROG shape ${NS_PREFIX}0 800 200"
  local i link="$2" flow="$3" v
  i="$(host_index "$1")"
  for v in "$link" "$flow"; do
    [[ "$v" =~ ^[0-9]+$ ]] || die "'$v' is not a non-negative integer; usage: $PROG shape HOST LINK_MBIT FLOW_MBIT"
  done
  link=$((10#$link)); flow=$((10#$flow))
  check_rates "$link" "$flow"
  shape_host "$i" "$link" "$flow"
}

# ----------------------------------------------------------------------------------------------------- main

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down; say "down: removed the emulated cluster (if there was one)" ;;
  status) shift; cmd_status ;;
  check) shift; cmd_check "$@" ;;
  shape) shift; cmd_shape "$@" ;;
  *) die "usage: $PROG up HOSTS LINK_MBIT FLOW_MBIT [SLOTS] | down | status | shape HOST LINK_MBIT FLOW_MBIT |" \
         "check [SECONDS [HOST_A HOST_B]]" ;;
esac

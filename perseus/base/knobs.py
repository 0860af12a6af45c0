"""Every perseus setting, declared once.

Each :class:`Knob` names the setting, its environment variables (the ``PERSEUS_*`` name wins over the
``HOROVOD_*`` name), its type, default and unit. The engine reads :func:`load_settings`; the launcher
(``perseusrun``) maps its command-line flags onto the same environment variables; ``docs/configuration.md``
is generated from :data:`KNOBS` by ``tools/gen_config_docs.py``. Which knobs the native core reads, and into
which field of its struct, is :data:`perseus.engine.settings.ENGINE_FIELDS` (``native/settings.h`` is
generated from it and these defaults by ``tools/gen_settings.py``).

What a knob is, how its text is parsed and the :class:`Settings` that hold the resolved values are
:mod:`perseus.base.knob_types` (imported here, so every name stays importable from this module). Resolving a
knob raises ``ValueError`` naming the environment variable whose text does not parse; :func:`knob` raises
``KeyError`` for an unknown name. This module is the one place that touches the process environment.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from perseus.base.knob_types import Flag, Knob, Settings, parse_bool, parse_reset_limit

__all__ = ["Knob", "KNOBS", "Settings", "load_settings", "read_knob", "knob", "parse_bool", "parse_reset_limit",
           "external", "set_external", "set_external_default"]


def _both(suffix: str) -> tuple[str, str]:
    return (f"PERSEUS_{suffix}", f"HOROVOD_{suffix}")


_AUTOTUNE = "autotune"


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold_bytes", _both("FUSION_THRESHOLD"), int, 4 << 20, unit="bytes", tunable=True,
         doc="Largest all-reduce unit. Ready tensors smaller than this are packed together up to it; larger "
             "tensors are split into units of this size. 0 disables packing (every tensor is its own unit). "
             "Horovod's default is 128 MiB; perseus measured 1-6 MiB units fastest on shared memory.",
         flag=Flag("--fusion-threshold-mb", "tuning", "largest all-reduce unit, in MB", scale=1 << 20)),
    Knob("inplace_threshold_bytes", ("PERSEUS_INPLACE_THRESHOLD",), int, 256 << 10, unit="bytes", tunable=True,
         doc="Tensors at least this large are reduced where they lie (no copy into a fusion buffer)."),
    Knob("engine_lane_bytes", ("PERSEUS_ENGINE_LANE_BYTES",), int, 64 << 10, unit="bytes",
         doc="Host all-reduce units up to this size that MPI's own algorithm carries are moved by the engine "
             "thread that negotiated them (a non-blocking all-reduce it polls while it goes on negotiating) "
             "instead of a channel thread: one thread hand-off less per synchronous round trip. 0: every unit "
             "goes to a channel."),
    Knob("huge_pages", ("PERSEUS_HUGE_PAGES",), bool, True,
         doc="Ask Linux (6.1+, MADV_COLLAPSE) to back host buffers of at least 1 MiB that all-reduces move again "
             "and again (gradients kept between steps, fusion and scratch buffers) with transparent huge pages, "
             "the third time the same buffer is reduced: within a host MPI's cross-process copies of large "
             "messages are about twice as fast on them. Buffers at new addresses every step are left alone. "
             "Contents are kept; a frame's resident memory may grow to 2 MiB. 0 turns it off."),
    Knob("cycle_time_ms", _both("CYCLE_TIME"), float, 0.0, unit="ms", tunable=True,
         doc="How long the engine waits after the first new request before it negotiates. 0 (the default): "
             "it negotiates at once, and requests that arrive during a round are gathered into the next one, "
             "which costs microseconds; a positive value gathers more per round at the price of that much "
             "latency on every synchronous collective (Horovod's default is 1 ms).",
         flag=Flag("--cycle-time-ms", "tuning", "wait before negotiating new requests, in ms")),
    Knob("num_channels", ("PERSEUS_NUM_CHANNELS",), int, 0, unit="channels", tunable=True,
         doc="Concurrent communication channels per process set; each is a duplicated communicator driven "
             "by its own thread and, between hosts, has its own TCP connections. 0 (the default): init() "
             "chooses, the same on every rank: 8 when the job's ranks span more than one host (a single TCP "
             "flow rarely fills a link: on 2 emulated hosts with 200 Mbit/s per flow, ResNet-50's gradients "
             "took 1.19x the link bound with the default, 4.3x with 1 channel; docs/benchmarks.md), 1 on one "
             "shared-memory host (measured fastest there). A positive value is used as it is. Rank 0 logs the "
             "count in use at init() (PERSEUS_LOG_LEVEL=info). The autotuner starts from the chosen count and "
             "tunes it, unless it was set explicitly.",
         flag=Flag("--num-channels", "tuning", "concurrent communication channels", minimum=1)),
    Knob("max_channels", ("PERSEUS_MAX_CHANNELS",), int, 0, unit="channels",
         doc="Channels created per process set (0: as many as num_channels has in use). Run-time tuning may "
             "switch the number in use between 1 and this many at the same step on every rank; idle channels "
             "cost nothing."),
    Knob("allreduce_algorithm", ("PERSEUS_ALLREDUCE_ALGORITHM",), str, "auto", tunable=True,
         choices=("auto", "mpi", "ring", "hierarchical"),
         doc="How a large unit is all-reduced: mpi (MPI_Allreduce, then a scaling pass for Average), ring "
             "(reduce-scatter and allgather over point-to-point messages; each rank scales only its own "
             "segment, so Average costs 1/size of a pass), hierarchical (reduce-scatter inside each host, "
             "all-reduce of every rank's shard across hosts in parallel, all-gather inside the host; needs the "
             "same number of ranks on every host, else ring), or auto: for a large unit across hosts, "
             "hierarchical when every host runs the same number (>1) of ranks, else ring; on one host, ring "
             "when it saves the scaling pass; mpi for everything else. Across hosts, ring and hierarchical "
             "use each channel's own TCP connections, so channels are concurrent flows. Reduce-scatter and "
             "allgather follow the same choice: ring (or hierarchical, which runs them as a flat ring) makes "
             "them rings over the same path; auto does so from 64 kB (allgather only across hosts); mpi "
             "keeps MPI's collectives."),
    Knob("hierarchical_allreduce", _both("HIERARCHICAL_ALLREDUCE") + ("HOROVOD_TORUS_ALLREDUCE",), bool, False,
         doc="Use the hierarchical all-reduce (as PERSEUS_ALLREDUCE_ALGORITHM=hierarchical; an algorithm "
             "other than auto named there wins). Horovod's torus all-reduce (HOROVOD_TORUS_ALLREDUCE, "
             "--torus-allreduce: reduce inside each host, then across hosts in parallel) is the same thing "
             "here.",
         flag=Flag("--hierarchical-allreduce", "tuning", "reduce inside each host first, then across hosts",
                   negation="--no-hierarchical-allreduce", aliases=("--torus-allreduce",),
                   negation_aliases=("--no-torus-allreduce",))),
    Knob("hierarchical_allgather", _both("HIERARCHICAL_ALLGATHER"), bool, False,
         doc="Gather inside each host first, exchange one block per host across hosts, then share it inside "
             "the host (needs the same number of ranks on every host, else a flat allgather).",
         flag=Flag("--hierarchical-allgather", "tuning", "gather inside each host first, then across hosts",
                   negation="--no-hierarchical-allgather")),
    Knob("network_interface", ("PERSEUS_NETWORK_INTERFACE", "HOROVOD_GLOO_IFACE"), str, "",
         doc="Comma-separated network interfaces whose IPv4 addresses the channels' own TCP connections "
             "between hosts use (perseusrun --network-interface sets it). Empty: every interface that is up, "
             "except loopback."),
    Knob("init_timeout_s", ("PERSEUS_INIT_TIMEOUT_SECONDS",), float, 60.0, unit="s",
         doc="How long init() waits for every rank of the job to call it. A rank that failed or exited before "
             "init() would otherwise leave the others waiting for ever; after this wait the job is aborted with "
             "a message saying so. 0 waits without limit."),
    Knob("link_timeout_s", ("PERSEUS_LINK_TIMEOUT_SECONDS",), float, 30.0, unit="s",
         doc="How long a channel waits to connect to a peer host, and how long a transfer between hosts may "
             "make no progress, before the collective fails on every rank."),
    Knob("cache_capacity", _both("CACHE_CAPACITY"), int, 4096, unit="tensors",
         doc="How many negotiated tensor signatures each process set keeps (least recently used names are "
             "dropped beyond it and negotiated again if they return). A steady-state step whose names are all "
             "kept costs one bit-vector all-reduce; 0 negotiates every name every time.",
         flag=Flag("--cache-capacity", "tuning", "negotiated tensor signatures kept per process set")),
    Knob("stall_check_disable", _both("STALL_CHECK_DISABLE"), bool, False,
         doc="Disable the stall inspector (no warnings, no stall shutdown).",
         flag=Flag("--no-stall-check", "stall check", "disable the stall inspector", negation="--stall-check")),
    Knob("stall_check_time_s", ("PERSEUS_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
         float, 60.0, unit="s",
         doc="Seconds a request may wait for other ranks before a warning names the tensor and the ranks "
             "that have not submitted it.",
         flag=Flag("--stall-check-warning-time-seconds", "stall check", "warn after a request waited this long")),
    Knob("stall_shutdown_time_s", ("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
         float, 300.0, unit="s",
         doc="Seconds a request may wait before every rank fails with the stall message instead of hanging. "
             "0 waits forever (Horovod's default; perseus fails loudly by default).",
         flag=Flag("--stall-check-shutdown-time-seconds", "stall check",
                   "fail every rank after a request waited this long (0: never)")),
    Knob("timeline", _both("TIMELINE"), str, "",
         doc="Path of a Chrome-trace JSON timeline written by rank 0, or DYNAMIC to allow "
             "start_timeline()/stop_timeline() without starting one.",
         flag=Flag("--timeline-filename", "timeline", "write a Chrome-trace timeline to this file (rank 0)")),
    Knob("timeline_mark_cycles", _both("TIMELINE_MARK_CYCLES"), bool, False,
         doc="Mark every negotiation cycle (CYCLE_START) in the timeline.",
         flag=Flag("--timeline-mark-cycles", "timeline", "mark negotiation cycles in the timeline",
                   negation="--no-timeline-mark-cycles")),
    Knob("timeline_max_bytes", ("PERSEUS_TIMELINE_MAX_BYTES",), int, 256 << 20, unit="bytes",
         doc="The timeline stops recording (and says so in the file) once it reaches this size."),
    Knob("dynamic_process_sets", _both("DYNAMIC_PROCESS_SETS"), bool, False,
         doc="Allow add_process_set()/remove_process_set() after init()."),
    Knob("elastic", _both("ELASTIC"), bool, False, doc="Elastic mode (set by an elastic launcher)."),
    Knob("elastic_reset_limit", ("PERSEUS_ELASTIC_RESET_LIMIT",), parse_reset_limit, 3, unit="resets",
         doc="Resets one elastic run() call may do before it re-raises: an integer >= 0, or none for no limit. "
             "Unset: 3 in a job not started by an elastic launcher, no limit under one (its own limit "
             "governs)."),
    Knob("log_level", _both("LOG_LEVEL"), str, "warning",
         choices=("trace", "debug", "info", "warning", "error", "fatal"),
         doc="Engine log level.",
         flag=Flag("--log-level", "logging", "engine log level")),
    Knob("log_hide_time", _both("LOG_HIDE_TIME"), bool, False, doc="Omit timestamps from engine log lines.",
         flag=Flag("--log-without-timestamp", "logging", "omit timestamps from engine log lines",
                   negation="--log-with-timestamp", aliases=("--log-hide-timestamp",),
                   negation_aliases=("--no-log-hide-timestamp",))),
    Knob("mpi_threads_disable", _both("MPI_THREADS_DISABLE"), bool, False,
         doc="Accepted for Horovod compatibility and ignored, with a warning at init(): perseus's engine and "
             "channel threads need MPI_THREAD_MULTIPLE, so MPI is always initialised with it.",
         flag=Flag("--mpi-threads-disable", "tuning",
                   "accepted for horovodrun compatibility and ignored (perseus needs MPI_THREAD_MULTIPLE)",
                   negation="--no-mpi-threads-disable")),
    Knob("thread_affinity", _both("THREAD_AFFINITY"), str, "",
         doc="Pin each rank's engine thread (negotiation and completion) to a CPU core: comma-separated core "
             "ids, one per local rank (local rank i takes entry i modulo their number). Channel threads and "
             "the framework's threads keep their placement. Empty: no pinning.",
         flag=Flag("--thread-affinity", "tuning", "core id(s) for each rank's engine thread, one per local rank")),
    Knob("num_nccl_streams", _both("NUM_NCCL_STREAMS"), int, 1, unit="streams",
         doc="NCCL channels per process set for all-reduces of GPU tensors (horovodrun's --num-nccl-streams): "
             "each is a process group with its own NCCL communicator and stream, and the engine's units go to "
             "them in turn, so that several run at once. See docs/gpu.md.",
         flag=Flag("--num-nccl-streams", "tuning", "NCCL channels (communicator and stream each) for all-reduces "
                   "of GPU tensors", minimum=1)),
    Knob("stage_cpu_tensors", ("PERSEUS_STAGE_CPU_TENSORS",), bool, False,
         doc="Send torch CPU tensors through the host-staging path that GPU tensors take (a copy in, the "
             "engine, a copy back at synchronize). For testing that path without a GPU; it only adds copies."),
    Knob("device_fusion_threshold_bytes", ("PERSEUS_DEVICE_FUSION_THRESHOLD",), int, 64 << 20, unit="bytes",
         doc="Fusion threshold for all-reduces of GPU tensors through NCCL: tensors are packed (a device-to-device "
             "copy) into units of up to this many bytes, larger ones are split at it. Horovod's default (64 MiB); "
             "the CPU channels' HOROVOD_FUSION_THRESHOLD does not apply to them."),
    Knob("device_bucket_bytes", ("PERSEUS_DEVICE_BUCKET_BYTES",), int, 25 << 20, unit="bytes",
         doc="Budget of the size-based buckets that GPU all-reduces travel in. After the first training step the "
             "engine knows the order in which gradients become ready (the same on every rank) and groups them, "
             "in that order, into buckets that close once they hold this many bytes (the first bucket of a step "
             "once it holds 1 MiB, so that communication starts early); a bucket is one NCCL launch, sent once "
             "all its gradients are ready. Tensors of at least this size travel alone. Unset: 25 MiB until a "
             "process set's NCCL groups are built, then chosen from the measured launch cost and bandwidth "
             "(25-256 MiB). 0: no buckets (each negotiation round's ready gradients are one launch). See "
             "docs/gpu.md."),
    Knob("device_cycle_time_ms", ("PERSEUS_DEVICE_CYCLE_TIME_MS",), float, 1.0, unit="ms",
         doc="While GPU all-reduces keep arriving (the previous negotiation round found work) and nothing else is "
             "new, how long the engine waits before the next round, so that the gradients of a backward pass "
             "travel in few NCCL launches. A GPU all-reduce reaching an idle engine is negotiated at once, and CPU "
             "requests never wait for it; HOROVOD_CYCLE_TIME, if larger, applies instead."),
    Knob("device_backend", ("PERSEUS_DEVICE_BACKEND",), str, "auto", choices=("auto", "nccl", "stage", "gloo"),
         doc="How torch collectives of GPU tensors move data. 'auto': NCCL when this torch has it (all-reduce, "
             "broadcast, allgather, alltoall, reducescatter; what NCCL cannot do is staged through host "
             "memory), else staging; 'nccl': the same, but an error without NCCL; 'stage': always through host "
             "memory; 'gloo': CPU tensors' collectives go through the GPU launcher with torch's Gloo backend "
             "(for testing the launcher without a GPU). Every rank must use the same value. See docs/gpu.md."),
    Knob("abort_on_exception", ("PERSEUS_ABORT_ON_EXCEPTION",), bool, True,
         doc="After init(), an uncaught exception on any rank prints its traceback and aborts the whole MPI "
             "job, so the other ranks do not hang."),
    Knob("gc_freeze", ("PERSEUS_GC_FREEZE",), bool, True,
         doc="At init(), move every object that exists (framework modules, the model) to Python's permanent "
             "GC generation (gc.freeze()). Full collections then skip them: after importing torch one takes "
             "~80 ms and stalls every thread, including perseus's, every few dozen steps."),
    Knob("idle_poll_max_ms", ("PERSEUS_IDLE_POLL_MAX_MS",), float, 50.0, unit="ms",
         doc="Longest sleep of an idle engine between checks for control messages from peers (stall probes, "
             "aborts). Only diagnostics wait on it; data never does."),
    Knob("cache_dir", ("PERSEUS_CACHE_DIR",), str, "",
         doc="Where perseus keeps what it builds on first use (the TensorFlow await op). Empty: "
             "$XDG_CACHE_HOME/perseus, else ~/.cache/perseus."),
    Knob("tf_async_op", ("PERSEUS_TF_ASYNC_OP",), bool, True,
         doc="Build (once, with the system C++ compiler) and use an asynchronous TensorFlow op that waits for a "
             "graph-mode collective without holding a TensorFlow thread. Off, or when it cannot be built, the "
             "wait blocks a thread, and a TF1 session with more concurrent collectives than inter-op threads "
             "can stall."),
    Knob("autotune", _both("AUTOTUNE"), bool, False,
         doc="Tune the unit size, in-place threshold, channels, cycle time and all-reduce algorithm at run time: "
             "a bandit over grid search, Bayesian optimisation, Hyperband and population-based training, fed "
             "with measured step times (docs/autotune.md). Parameters set explicitly are not tuned.",
         flag=Flag("--autotune", _AUTOTUNE, "tune settings at run time", negation="--no-autotune")),
    Knob("autotune_log", _both("AUTOTUNE_LOG"), str, "",
         doc="CSV log of the autotune samples (rank 0): Horovod's columns, then perseus's.",
         flag=Flag("--autotune-log-file", _AUTOTUNE, "CSV log of autotune samples")),
    Knob("autotune_warmup_samples", _both("AUTOTUNE_WARMUP_SAMPLES"), int, 1, unit="samples",
         doc="Samples (of autotune_steps_per_sample steps) left untouched at the start, before tuning begins "
             "(Horovod's default is 3).",
         flag=Flag("--autotune-warmup-samples", _AUTOTUNE)),
    Knob("autotune_steps_per_sample", _both("AUTOTUNE_STEPS_PER_SAMPLE"), int, 2, unit="steps",
         doc="Training steps measured per sample; the sample's score is their median (the slowest rank's). "
             "Horovod's default is 10.",
         flag=Flag("--autotune-steps-per-sample", _AUTOTUNE, minimum=1)),
    Knob("autotune_budget_steps", ("PERSEUS_AUTOTUNE_BUDGET_STEPS",), int, 100, unit="steps",
         doc="Training steps the search may spend (they are ordinary training steps); then the best setting "
             "is kept for the rest of the run.",
         flag=Flag("--autotune-budget-steps", _AUTOTUNE, minimum=1)),
    Knob("autotune_retune_drift", ("PERSEUS_AUTOTUNE_RETUNE_DRIFT",), float, 0.0,
         doc="After tuning, search again when the median step time of 50 steps exceeds the first such median "
             "after tuning by this fraction (e.g. 0.2) twice in a row. 0 (the default): tune once."),
    Knob("autotune_fixed", ("PERSEUS_AUTOTUNE_FIXED",), str, "explicit",
         doc="Which tuned parameters keep their value: 'explicit' (those set in the environment, as Horovod "
             "does), 'none' (explicit values are only the starting point of the search), or a comma-separated "
             "list of fusion_threshold_bytes, inplace_threshold_bytes, channels, cycle_time_us, algorithm, "
             "compression_policy (Espresso's policy, when an Espresso compressor takes part), "
             "sparse_algorithm (the algorithm of 'auto' sparse all-reduces, when the job has them), "
             "dear_threshold (DeAR's group size, when a schedule='dear' optimizer takes part), device_bucket "
             "(the device buckets' budget) and device_path (the GPU launcher or host staging), when all-reduces "
             "go through the GPU launcher."),
    Knob("autotune_bayes_opt_max_samples", _both("AUTOTUNE_BAYES_OPT_MAX_SAMPLES"), int, 20, unit="samples",
         doc="When set, the most samples the search takes (it also stops when autotune_budget_steps are spent); "
             "unset, only the step budget counts.",
         flag=Flag("--autotune-bayes-opt-max-samples", _AUTOTUNE, minimum=1)),
    Knob("autotune_gaussian_process_noise", _both("AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), float, 0.8,
         doc="Noise of Horovod's Gaussian process. Accepted and not used: perseus's Bayesian technique (Optuna's "
             "TPE) takes no noise level; noise is handled by medians over steps and a re-measurement of the two "
             "best settings.",
         flag=Flag("--autotune-gaussian-process-noise", _AUTOTUNE)),
    Knob("topk_selector", ("PERSEUS_TOPK_SELECTOR",), str, "auto",
         doc="How top-k compressors pick the largest entries: 'auto' (the fastest of the others, timed on this "
             "machine once per size class), 'exact' (NumPy introselect), 'torch' (torch.topk), 'mstopk' "
             "(threshold bisection, approximate) or 'dgc' (sampled threshold, then exact). "
             "See docs/compression.md."),
    Knob("run_token", ("PERSEUS_RUN_TOKEN",), str, "",
         doc="Set by perseus.run for the ranks it starts: the secret a rank presents when it fetches the "
             "function from the calling process. Not for people to set."),
    Knob("remote_token", ("PERSEUS_REMOTE_TOKEN",), str, "",
         doc="Set by perseus.ray for the ranks it starts: the secret a rank presents to its actor. Not for people "
             "to set."),
    Knob("remote_links", ("PERSEUS_REMOTE_LINKS",), str, "",
         doc="Set by perseus.ray for the ranks it starts: each rank's actor address (ip:port), comma separated, "
             "in rank order. Not for people to set."),
    Knob("nonfinite_gradients", ("PERSEUS_NONFINITE_GRADIENTS",), str, "off",
         choices=("off", "raise", "skip"),
         doc="Check each gradient for NaN/Inf on its own rank before it is reduced (torch DistributedOptimizer): "
             "'raise' fails every rank at the same step with NonFiniteGradientError naming the tensors and the "
             "ranks, 'skip' skips that optimizer step on every rank (a warning names them), 'off' checks "
             "nothing. Costs one pass over each gradient and one small all-reduce per step when on. See "
             "docs/troubleshooting.md."),
    Knob("dear_threshold_bytes", ("PERSEUS_DEAR_THRESHOLD_BYTES",), int, 4 << 20, unit="bytes",
         doc="Largest fusion group of DistributedOptimizer(schedule='dear'): consecutive modules, in forward "
             "order, are grouped up to this many gradient bytes (a module larger than this is a group of its "
             "own; 0: one group per module). Each group is one reduce-scatter during backward and one "
             "all-gather before its next forward; smaller groups overlap more, larger ones pay fewer "
             "collective start-ups. optimizer.set_dear_threshold() changes it during a run. See docs/dear.md."),
    Knob("sparse_algorithm", ("PERSEUS_SPARSE_ALGORITHM",), str, "auto",
         choices=("auto", "zen", "allgather", "dense", "alltoall"),
         doc="How sparse gradients (torch sparse tensors, tf.IndexedSlices) are reduced when no algorithm is "
             "passed: zen (hash-partitioned push, sum at the owner, hash-bitmap pull), allgather (Horovod's "
             "path), dense (densify and all-reduce; the result stays sparse), alltoall (column partition), or "
             "auto: per tensor, the cheapest by a cost model fed with the measured density, overlap, imbalance "
             "and link (docs/sparse.md). sparse_as_dense=True still densifies the gradient itself."),
    Knob("zen_hash_funcs", ("PERSEUS_ZEN_HASH_FUNCS",), int, 3, unit="hashes",
         doc="Slot hashes k of Zen's hierarchical hash partition (with PERSEUS_ZEN_PARTITIONER=hash)."),
    Knob("zen_load_factor", ("PERSEUS_ZEN_LOAD_FACTOR",), float, 0.5,
         doc="Rows per parallel slot of Zen's hierarchical hash partition: each owner gets "
             "nnz / (ranks * load factor) slots (0.5: twice as many slots as rows)."),
    Knob("zen_serial_fraction", ("PERSEUS_ZEN_SERIAL_FRACTION",), float, 0.1,
         doc="Size of the serial region of Zen's hierarchical hash partition, as a fraction of the parallel "
             "region; when more rows are left over it is grown to fit, so no row is ever dropped."),
    Knob("zen_partitioner", ("PERSEUS_ZEN_PARTITIONER",), str, "bucket", choices=("bucket", "hash", "check"),
         doc="How Zen splits rows by owner: bucket (hash, then a counting sort: the fast path on CPU), hash "
             "(the paper's hierarchical hash partition) or check (both, compared on every call; for tests). "
             "All give the same rows to every owner."),
    Knob("zen_seed", ("PERSEUS_ZEN_SEED",), int, 0,
         doc="Master seed of Zen's hashes; 0 (the default): the first rank of each process set draws one. "
             "Either way the first rank's seed is broadcast and the resulting partition hash is checked on "
             "every rank."),
    Knob("sparse_latency_us", ("PERSEUS_SPARSE_LATENCY_US",), float, 0.0, unit="us",
         doc="Cost of one collective for the sparse cost model; 0: measured (timed all-reduces at the first "
             "'auto' choice on a process set)."),
    Knob("sparse_bandwidth_mbit", ("PERSEUS_SPARSE_BANDWIDTH_MBIT",), float, 0.0, unit="Mbit/s",
         doc="Link bandwidth per rank for the sparse cost model; 0: measured with the latency."),
    # Set by the elastic launcher (perseusrun --host-discovery-script ...) for the ranks it starts.
    Knob("elastic_driver", ("PERSEUS_ELASTIC_DRIVER",), str, "",
         doc="Set by the elastic launcher: host:port of its driver, which each rank reports to and hears host "
             "changes from. Not for people to set."),
    Knob("elastic_token", ("PERSEUS_ELASTIC_TOKEN",), str, "",
         doc="Set by the elastic launcher: the secret ranks present to its driver and to the checkpoint "
             "keepers. Not for people to set."),
    Knob("elastic_generation", ("PERSEUS_ELASTIC_GENERATION",), int, 0,
         doc="Set by the elastic launcher: how many times the job has been re-formed (0: first launch). A "
             "rank of a later generation restores the last commit from the keepers. Not for people to set."),
    Knob("elastic_hosts", ("PERSEUS_ELASTIC_HOSTS",), str, "",
         doc="Set by the elastic launcher: host:slots of this generation, in rank order. Not for people to set."),
    Knob("elastic_keepers", ("PERSEUS_ELASTIC_KEEPERS",), str, "",
         doc="Set by the elastic launcher: host=address:port of every running checkpoint keeper, "
             "comma-separated. Not for people to set."),
    Knob("elastic_in_process", ("PERSEUS_ELASTIC_IN_PROCESS",), bool, True,
         doc="Elastic jobs: when a rank dies, the survivors re-form the job among themselves without "
             "restarting (MPI's fault-tolerance extension, ULFM: revoke, shrink, re-initialise), restoring their "
             "last commit from their own memory, when the MPI supports it; otherwise, or when this is off, the "
             "launcher starts the job again and the ranks restore from the keepers."),
    Knob("elastic_heartbeat_timeout", ("PERSEUS_ELASTIC_HEARTBEAT_TIMEOUT",), float, 10.0, unit="s",
         doc="Elastic launcher: a rank silent this long (stopped, or its host cut off) is taken as failed; its "
             "host is blacklisted and the job re-formed without it."),
    Knob("elastic_snapshot", ("PERSEUS_ELASTIC_SNAPSHOT",), str, "async", choices=("async", "sync"),
         doc="TorchState.commit(): 'async' copies the tensors only an optimizer of the state changes (its "
             "parameters and state) on a background thread while training goes on, the optimizer's step() "
             "waiting for the copy; 'sync' copies everything before commit() returns. Buffers are reused from "
             "commit to commit either way."),
    # Read by perseus.spark when its caller passes no timeout.
    Knob("spark_start_timeout", ("PERSEUS_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT"), float, 600.0, unit="s",
         doc="perseus.spark.run and run_elastic without start_timeout: how long the driver waits for the job's "
             "Spark tasks to start and register (Spark may have to acquire executors first)."),
    Knob("spark_elastic_timeout", ("PERSEUS_SPARK_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"), float, 600.0,
         unit="s",
         doc="perseus.spark.run_elastic without elastic_timeout: how long an elastic job waits for at least "
             "min_np slots (perseusrun takes --elastic-timeout instead)."),
    Knob("gemini_peers", ("PERSEUS_GEMINI_PEERS",), int, 0, unit="hosts",
         doc="Elastic jobs: besides the copy in its own host's keeper, each rank's commit is also sent to this "
             "many other hosts' keepers, placed by Gemini's mixed strategy. 0 (the default): none, because in "
             "data-parallel training every rank commits the same state, so each host's keeper already holds "
             "a copy of it: a job on H hosts keeps H copies in H hosts' memory without sending any."),
    Knob("gemini_chunk_bytes", ("PERSEUS_GEMINI_CHUNK_BYTES",), int, 1 << 20, unit="bytes",
         doc="Elastic jobs: commits travel to the keepers in chunks of this size, sent by a background thread "
             "when the training's own collectives leave the network idle (each chunk waits at most "
             "PERSEUS_GEMINI_MAX_DEFER_MS for such a gap)."),
    Knob("gemini_max_defer_ms", ("PERSEUS_GEMINI_MAX_DEFER_MS",), float, 50.0, unit="ms",
         doc="Elastic jobs: the longest a chunk of a commit's copy waits for a gap in the training's own "
             "traffic before it is sent anyway. 0: send at once."),
    Knob("gemini_sync", ("PERSEUS_GEMINI_SYNC",), bool, False,
         doc="Elastic jobs: commit() returns only once every copy of the commit is stored in the keepers. Off "
             "(the default): commit() returns once the state is snapshotted in memory, the copies travel in the "
             "background and the next commit waits for them."),
    Knob("gemini_disk_dir", ("PERSEUS_GEMINI_DISK_DIR",), str, "",
         doc="Elastic jobs: also write every PERSEUS_GEMINI_DISK_EVERY-th commit of rank 0 to this directory "
             "(the last place a restore looks, after the keepers' memory). Empty: no disk copy."),
    Knob("gemini_disk_every", ("PERSEUS_GEMINI_DISK_EVERY",), int, 100, unit="commits",
         doc="Elastic jobs with PERSEUS_GEMINI_DISK_DIR: how often a commit is also written to disk."),
)

_BY_NAME = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    """Return the knob called ``name``; raise ``KeyError`` listing the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown perseus setting {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def read_knob(name: str, environ: Mapping[str, str] | None = None) -> tuple[Any, bool]:
    """Resolve the knob ``name`` now: ``(value, explicitly_set)`` from ``environ`` (default ``os.environ``).

    For settings consulted outside ``init()`` (the elastic reset limit); everything else reads the
    :class:`Settings` that ``init()`` loaded.
    """
    return knob(name).read(os.environ if environ is None else environ)


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Resolve every knob from ``environ`` (default ``os.environ``), then apply ``overrides`` by knob name."""
    environ = os.environ if environ is None else environ
    values, explicit = {}, set()
    for k in KNOBS:
        values[k.name], was_set = k.read(environ)
        if was_set:
            explicit.add(k.name)
    for name, value in overrides.items():
        knob(name)
        values[name] = value
        explicit.add(name)
    return Settings(values, frozenset(explicit))


# -- variables that belong to others ---------------------------------------------------------------------
# Launchers (rank and size), the C++ toolchain (CXX), the XDG base directories and MPI's own parameters are
# not perseus settings, but perseus reads or presets some of them. They pass through here so that this
# module stays the one place that touches the process environment.

def external(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of the environment variable ``name`` that another program defines, or ``default``."""
    return os.environ.get(name, default)


def set_external(name: str, value: Optional[str]) -> None:
    """Set the environment variable ``name`` to ``value`` for this process and its children; None unsets it.
    (For Horovod's ``common.util.env`` test helper; perseus itself reads settings only.)"""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def environment() -> dict[str, str]:
    """A copy of this process's environment (Horovod's Ray worker reports it)."""
    return dict(os.environ)


def set_external_default(name: str, value: str) -> None:
    """Set the environment variable ``name`` for libraries loaded later in this process (MPI reads its
    ``OMPI_MCA_*`` parameters at initialisation), unless the user already chose a value."""
    os.environ.setdefault(name, value)

"""The optional dimensions of the search: which of them it covers, decided by rank 0 at its first start.

The compressor policy, the sparse algorithm, DeAR's group size and the GPU path are step-aligned: each follows
the tuner through a link (:class:`~perseus.runtime.step_policy.PolicyLink`) and switches at a step boundary
agreed on by every rank. The device buckets' budget travels in the TUNE request itself: its link
(:class:`_InTune`) does nothing. :class:`_Dimensions` is part of :class:`~perseus.autotune.tuner.Tuner` (which
sets the state it reads in its ``__init__``): only rank 0 runs its ``_*_dimension`` methods, which widen the
search space and its starting point; the other ranks learn the outcome from rank 0's next word. Waiting for a
compressor's decision raises :class:`~perseus.autotune.plumbing._Stopped` once the tuner is asked to stop.
"""

from __future__ import annotations

import dataclasses
import sys

from perseus.autotune.plumbing import _POLL_S, _Stopped
from perseus.autotune.space import (COMPRESSION_POLICIES, DEAR, DEAR_THRESHOLDS, DEVICE, DEVICE_BUCKETS, DEVICE_PATHS,
                                    PATH, POLICY, SPARSE, SPARSE_ALGORITHMS)
from perseus.sparse import choice

__all__: list[str] = []


class _InTune:
    """The link of a dimension the TUNE request carries (the device buckets' budget): nothing to post."""

    done = True

    def post(self, value: int, done: bool = False) -> None:
        pass

    def end(self) -> None:
        pass


def _launched_on_device() -> bool:
    """Whether some all-reduce of the global set has gone through the torch GPU launcher (perseus.torch.device)
    in this job (False when torch is not loaded)."""
    device = sys.modules.get("perseus.torch.device")
    launcher = getattr(device, "_launcher", None)
    return launcher is not None and bool(launcher.counts.get(0, (0,))[0])


class _Dimensions:
    """Rank 0's choice of the optional dimensions (methods of :class:`~perseus.autotune.tuner.Tuner`)."""

    def _policy_dimension(self) -> bool:
        """Rank 0, at the start of the first search: whether the compressor policy is searched (and if so, add
        it to the space and start from the compressor's policy). Only when a compressor has registered, its
        policy is not kept (PERSEUS_AUTOTUNE_FIXED), and it has made its decision (before that every policy
        sends every gradient dense: nothing to measure)."""
        compressor = self.policy.registered()
        if compressor is None:
            return False
        if self._fixed_step[POLICY] or (self._policy_explicit_kept and getattr(compressor, "policy_explicit", False)):
            print(f"perseus autotune: the compression policy stays {compressor.policy!r}", file=sys.stderr,
                  flush=True)
            return False
        if not self._await_decision(compressor):
            print("perseus autotune: the compressor made no decision in time; its policy is not tuned",
                  file=sys.stderr, flush=True)
            return False
        self.space = self.space.with_policies(range(len(COMPRESSION_POLICIES)))
        self.initial = dataclasses.replace(self.initial,
                                           compression_policy=COMPRESSION_POLICIES.index(compressor.policy))
        return True

    def _sparse_dimension(self) -> bool:
        """Rank 0, at the start of the first search: whether the sparse algorithm is searched (and if so, add
        it to the space and start from the algorithm in force). Only when the sparse path has registered (an
        'auto' sparse all-reduce ran) and its algorithm is not kept (PERSEUS_AUTOTUNE_FIXED, or with
        'explicit' a perseus.sparse.set_policy() of the program)."""
        if self.sparse.registered() is None:
            return False
        if self._fixed_step[SPARSE] or (self._policy_explicit_kept and choice.policy_explicit()):
            print(f"perseus autotune: the sparse algorithm stays {choice.policy() or 'auto'!r}", file=sys.stderr,
                  flush=True)
            return False
        self.space = self.space.with_sparse(range(len(SPARSE_ALGORITHMS)))
        self.initial = dataclasses.replace(self.initial, sparse_algorithm=choice.tuned_index())
        return True

    def _dear_dimension(self) -> bool:
        """Rank 0, at the start of the first search: whether DeAR's group size is searched (a DeAR optimizer
        has registered, and neither PERSEUS_AUTOTUNE_FIXED nor an explicit PERSEUS_DEAR_THRESHOLD_BYTES keeps
        it); if so, the search starts from the candidate nearest to the optimizer's size."""
        optimizer = self.dear.registered()
        if optimizer is None:
            return False
        current = int(getattr(optimizer, "_dear_threshold", DEAR_THRESHOLDS[2]))
        if self._fixed_step[DEAR]:
            print(f"perseus autotune: DeAR's group size stays {current / (1 << 20):g} MB", file=sys.stderr,
                  flush=True)
            return False
        self.space = self.space.with_choices(DEAR, range(len(DEAR_THRESHOLDS)))
        nearest = min(range(len(DEAR_THRESHOLDS)), key=lambda i: (abs(DEAR_THRESHOLDS[i] - current), i))
        self.initial = dataclasses.replace(self.initial, dear_threshold=nearest)
        return True

    def _device_dimension(self) -> bool:
        """Rank 0, at the start of the first search: whether the device buckets' budget is searched (the job's
        all-reduces have gone through the GPU launcher, buckets are on, and neither PERSEUS_AUTOTUNE_FIXED nor an
        explicit PERSEUS_DEVICE_BUCKET_BYTES keeps it); if so, the search starts from the candidate nearest to
        the budget in force (the one measured when the launcher's groups were built)."""
        current = int(self.engine.params(0)[6])
        if current <= 0 or not _launched_on_device():
            return False
        if self._fixed_step[DEVICE]:
            print(f"perseus autotune: the device buckets' budget stays {current / (1 << 20):g} MB",
                  file=sys.stderr, flush=True)
            return False
        self.space = self.space.with_choices(DEVICE, range(len(DEVICE_BUCKETS)))
        nearest = min(range(len(DEVICE_BUCKETS)), key=lambda i: (abs(DEVICE_BUCKETS[i] - current), i))
        self.initial = dataclasses.replace(self.initial, device_bucket=nearest)
        return True

    def _path_dimension(self) -> bool:
        """Rank 0, at the start of the first search: whether the GPU path is searched (a DistributedOptimizer
        whose gradients went through the launcher has registered, and neither PERSEUS_AUTOTUNE_FIXED nor an
        explicit PERSEUS_DEVICE_BACKEND keeps it); if so, the search starts from the launcher."""
        if self.path.registered() is None or not _launched_on_device():
            return False
        if self._fixed_step[PATH]:
            print("perseus autotune: the GPU path stays as PERSEUS_DEVICE_BACKEND sets it", file=sys.stderr,
                  flush=True)
            return False
        self.space = self.space.with_choices(PATH, range(len(DEVICE_PATHS)))
        self.initial = dataclasses.replace(self.initial, device_path=0)
        return True

    def _await_decision(self, compressor) -> bool:
        """Wait until the compressor has decided; False when it has passed the step of its decision without
        deciding, or the job has run many steps without it deciding (a compressor no longer used)."""
        follower = self.policy.follower
        decision_step = int(getattr(compressor, "warmup_steps", 0)) + int(getattr(compressor, "profile_steps", 1))
        began = self._completed()
        while not compressor.decided:
            late = follower is not None and follower.steps > decision_step + 1
            if (late or self._completed() - began > max(20, 4 * decision_step)) and not compressor.decided:
                return False
            if self._stop.wait(_POLL_S):
                raise _Stopped()
        return True

    def _shown(self) -> dict:
        """describe()'s flags: the step-aligned dimensions the search covers."""
        return {"policy": self._tuned[POLICY], "sparse": self._tuned[SPARSE], "dear": self._tuned[DEAR],
                "device": self._tuned[DEVICE], "path": self._tuned[PATH]}

    @property
    def _policy_tuned(self) -> bool:
        return self._tuned[POLICY]

    @property
    def _sparse_tuned(self) -> bool:
        return self._tuned[SPARSE]


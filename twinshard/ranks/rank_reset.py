"""What a rank of a shared world (``twinshard.ranks.worlds``) puts back between two tasks, so that each
task finds the rank as a fresh process would be, and what it had to put back is named.

``Snapshot`` is taken when the rank starts. Before a task, ``enter`` gives the rank the caller's
environment, working directory and ``sys.path`` and restarts the random generators from their
first state. After it, ``restore`` puts back:

- the process-wide settings of ``RESET`` (default dtype and device, grad mode, anomaly
  detection, deterministic algorithms, the switch), each named when it had changed;
- module globals (``WATCHED``): a replaced function, class or module (a task that wrapped
  ``dist.all_reduce``) is named and put back; the other globals of twinshard's modules imported
  when the rank started (``PRELOADED``: caches, counters) are put back silently;
- torch's process-wide hooks (``HOOK_MODULES``: every module's forward and backward hooks,
  every optimizer's step hooks) a task registered and left, named and removed;
- the caches of ``reset_caches`` (dynamo's compiled code, the stand-in streams, the guard's
  settings), the environment, the directory and the thread count.

A task that registered a device for good (PrivateUse1) cannot be undone: ``restore`` raises, and
the world is replaced.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
import types
import warnings
import weakref

import torch


class Snapshot:
    """What a rank looks like between tasks, taken when it starts; ``restore`` puts it back
    after a task and says what differed (``RESET``)."""

    def __init__(self):
        self.threads = torch.get_num_threads()
        numpy = sys.modules.get("numpy")
        self.rng = (torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state())
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.values = {name: get() for name, get, _ in RESET}
        self.device_backend = torch._C._get_privateuse1_backend_name()
        # (a module's globals, whether they are as a fresh process has them)
        self.modules: dict[str, tuple[dict, bool]] = {}
        self.contents: dict[tuple[str, str], object] = {}  # (module, global) -> a copy
        self._watch_new_modules(fresh=True)
        self.hooks = {key: dict(hooks) for key, hooks in _hook_registries()}

    def _watch_new_modules(self, fresh: bool) -> None:
        """Take the globals of every module of ``WATCHED`` imported since the last look."""
        for name, module in list(sys.modules.items()):
            if name.startswith(WATCHED) and name not in self.modules and module is not None:
                self.modules[name] = (dict(vars(module)), fresh)
                if fresh and name.startswith("twinshard"):  # and what its containers held
                    for key, value in vars(module).items():
                        if isinstance(value, CONTAINERS):
                            self.contents[name, key] = _contents(value)

    def _put_back_globals(self) -> list[str]:
        """Module globals a task rebound: put back. A replaced function, class or module is
        named (a task that wrapped ``dist.all_reduce`` and left it wrapped); the other globals
        of twinshard's modules imported when the rank started (``PRELOADED``: caches, counters,
        and what their dicts, sets and weak registries held) are put back silently, as a
        fresh process has them."""
        found = []
        for (name, key), held in self.contents.items():
            value = vars(sys.modules[name]).get(key)
            if isinstance(value, CONTAINERS) and _contents(value) != held:
                _refill(value, held)
        for name, (saved, fresh) in self.modules.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            now = vars(module)
            whole = fresh and name.startswith("twinshard")
            for key, value in saved.items():
                if now.get(key, _MISSING) is value:
                    continue
                code = callable(value) or isinstance(value, types.ModuleType)
                if code:
                    found.append(f"{name}.{key} was replaced, put back")
                if code or whole:
                    setattr(module, key, value)
        self._watch_new_modules(fresh=False)
        return found

    def enter(self, task: dict) -> None:
        """Take the caller's environment, directory and path; restart the generators."""
        os.environ.clear()
        os.environ.update(task["environ"])
        os.chdir(task["cwd"])
        sys.path[:] = task["path"] + [p for p in self.path if p not in task["path"]]
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        if self.rng[2] is not None:
            sys.modules["numpy"].random.set_state(self.rng[2])

    def _put_back_hooks(self) -> list[str]:
        """torch's process-wide hooks (every module's forward hooks, every optimizer's step
        hooks) a task registered and left: removed, and named, but twinshard's own (the
        guard's, once per process, forgotten with its module's globals)."""
        found = []
        for key, hooks in _hook_registries():
            saved = self.hooks.get(key, {})
            if hooks.keys() == saved.keys():
                continue
            added = [h for k, h in hooks.items() if k not in saved]
            theirs = [h for h in added if not getattr(h, "__module__", "").startswith("twinshard")]
            if theirs:
                found.append(f"{key} held {len(theirs)} more hook(s), removed")
            hooks.clear()
            hooks.update(saved)
        return found

    def restore(self) -> list[str]:
        gc.collect()  # the task's models, held in cycles: gone before their weak registries
        found = self._put_back_hooks()
        for name, get, put in RESET:
            now = get()
            if now != self.values[name]:
                found.append(f"{name} was {now!r}, set back to {self.values[name]!r}")
                put(self.values[name])
        found += self._put_back_globals()
        reset_caches()
        os.environ.clear()
        os.environ.update(self.environ)
        with contextlib.suppress(OSError):
            os.chdir(self.cwd)
        torch.set_num_threads(self.threads)
        if torch._C._get_privateuse1_backend_name() != self.device_backend:
            raise RuntimeError(
                "the task registered a device for good (PrivateUse1); run it in a process of "
                "its own (twinshard.ranks.fresh_process) or with launch outside the shared worlds"
            )
        return found


def _switched() -> str:
    switch = sys.modules.get("twinshard.switch")
    if switch is None:
        return "torch"
    return switch.active() + (
        f" with {switch.active_variants()}" if switch.active_variants() else ""
    )


def _switch_back(_value) -> None:
    sys.modules["twinshard.switch"].restore()


# The modules whose globals a task may not leave changed (``Snapshot._put_back_globals``), and
# those a rank imports as it starts.
WATCHED = ("twinshard", "torch.distributed")
PRELOADED = (
    "twinshard.reference",
    "twinshard.optimized",
    "twinshard.guard",
    "twinshard.dispatch.standin",
)
_MISSING = object()

# (name, read, put back): what a task may leave changed in its rank's process
RESET = [
    ("the default dtype", torch.get_default_dtype, torch.set_default_dtype),
    (
        "the default device",
        lambda: str(torch.get_default_device()),
        lambda device: torch.set_default_device(None if device == "cpu" else device),
    ),
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    (
        "deterministic algorithms",
        torch.are_deterministic_algorithms_enabled,
        torch.use_deterministic_algorithms,
    ),
    ("the switch (torch.distributed.fsdp.fully_shard)", _switched, _switch_back),
]


CONTAINERS = (
    dict,
    set,
    list,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
    weakref.WeakSet,
)


def _contents(container):
    if isinstance(container, dict | weakref.WeakKeyDictionary | weakref.WeakValueDictionary):
        return list(container.items())
    return list(container)


def _refill(container, held: list) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(held)
    elif isinstance(container, set | weakref.WeakSet):
        container.update(held)
    else:
        container.update(held)


# Modules of torch whose process-wide hook registries (their ``_global...`` dicts) a task may
# add to: a hook left there would run in every later task.
HOOK_MODULES = ("torch.nn.modules.module", "torch.optim.optimizer")


def _hook_registries():
    """(name, dict) of every process-wide hook registry of ``HOOK_MODULES``."""
    for name in HOOK_MODULES:
        module = sys.modules.get(name)
        for key, value in vars(module).items() if module is not None else ():
            if key.startswith("_global") and isinstance(value, dict):
                yield f"{name}.{key}", value


def reset_caches() -> None:
    """Caches a task fills that the next must not see: dynamo's compiled code, DTensor's
    sharding and redistribution plans (they hold the task's device meshes, whose process groups
    are gone: a plan found again for an equal mesh of the next task names a group that is not
    there), the stand-in streams and their log, the guard's per-collective checks."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import debug

        debug._clear_sharding_prop_cache()
    with warnings.catch_warnings():  # reading a deprecated name warns
        warnings.simplefilter("ignore")
        _clear_torch_distributed_caches()
    standin = sys.modules.get("twinshard.dispatch.standin")
    if standin is not None:
        standin.reset_standin_streams()
    channel = sys.modules.get("twinshard.guard.channel")
    if channel is not None:
        channel.refresh()


def _clear_torch_distributed_caches() -> None:
    """Every ``functools`` cache of torch.distributed's modules and of their classes."""
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and module is not None:
            for value in list(vars(module).values()):
                _clear(value)
                if isinstance(value, type) and value.__module__ == name:
                    for attribute in list(vars(value)):
                        _clear(getattr(value, attribute, None))


def _clear(value) -> None:
    """Empty ``value`` where it is a ``functools`` cache (a cached function, not a class)."""
    if isinstance(value, type):
        return
    clear = getattr(value, "cache_clear", None)
    if callable(clear) and hasattr(value, "cache_info"):
        clear()

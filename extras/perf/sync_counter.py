"""The host-sync counter of extras/perf/gpu_check.py (and of anyone who wants to know what makes
a training step wait for its GPU): a TorchDispatchMode that counts reads of a tensor's value,
data-dependent shapes and blocking copies, by the line that made them; on CUDA also CUDA's own
count. Not a script."""
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]

TORCH_DIR = os.path.dirname(torch.__file__)
# not the once-only 'Synchronization debug mode is a prototype'
CUDA_SYNC = "called a synchronizing CUDA operation"
# torch's reads of host tensors
HOST_SIDE = tuple(os.path.join(TORCH_DIR, d, "") for d in ("optim", "amp"))
aten = torch.ops.aten
# the counter's user: its own lines (the loader's clock) are not the training step's
GPU_CHECK = str(Path(__file__).with_name("gpu_check.py"))


# ======== Host syncs, counted on any device =======================================================
class SyncCounter(TorchDispatchMode):
    """While active, counts what makes the host wait for a GPU: reading a tensor's value
    (`.item()`, `bool()`, `float()`, `.tolist()`, `.numpy()`), operations whose output size depends
    on the data (`nonzero`, boolean-mask indexing, `unique`, ...), and copies to or from the host
    that do not say `non_blocking=True` (`torch.tensor(..., device=)`, `.to(device)`, `.cpu()`). On
    a CPU every tensor lives on the host, so the counter counts what *would* wait on a GPU; it
    leaves out torch's own reads in torch/optim (step counters kept on the host) and torch/amp (the
    fp16 grad scaler's one per step, which CUDA's count shows). `sites` names the line of each
    (file:line -> count). On CUDA it also takes CUDA's own count (`cuda`), from
    `torch.cuda.set_sync_debug_mode`."""
    DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                      aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default,
                      aten.repeat_interleave.Tensor, aten.bincount.default,
                      aten._local_scalar_dense.default}
    BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}

    def __init__(self):
        super().__init__()
        self.count = 0
        self.sites = {}
        self.saved = {}
        self.cuda = None
        self.cuda_sites = {}
        self.caught = None

    def note(self, cuda=False):
        """One sync, named by the first line outside torch, the warnings module and this file that
        made it: torch's own host-side reads are left out; CUDA's warnings (`cuda`) come from any
        thread."""
        frame = sys._getframe(2)
        skipped = (TORCH_DIR, warnings.__file__, __file__, GPU_CHECK)
        while frame is not None and frame.f_code.co_filename.startswith(skipped):
            if not cuda and frame.f_code.co_filename.startswith(HOST_SIDE):
                return
            frame = frame.f_back
        site = ("?" if frame is None
                else f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_lineno}")
        sites = self.cuda_sites if cuda else self.sites
        sites[site] = sites.get(site, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.DATA_DEPENDENT or (func in self.BOOL_INDEXED and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or []))):
            self.note()
        return func(*args, **(kwargs or {}))

    def patch(self, owner, name, counts):
        original = self.saved[(owner, name)] = getattr(owner, name)

        def counted(*args, **kwargs):  # torch's own calls of these keep tensors where they are
            caller = sys._getframe(1).f_code.co_filename
            if not caller.startswith(TORCH_DIR) and counts(*args, **kwargs):
                self.note()
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    def __enter__(self):
        def blocking_copy(_tensor, *args, **kwargs):
            device, _dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            return device is not None and not non_blocking
        for name in ("tolist", "numpy", "cpu"):
            self.patch(torch.Tensor, name, lambda *a, **k: True)
        self.patch(torch.Tensor, "to", blocking_copy)
        for name in ("tensor", "as_tensor"):
            self.patch(torch, name, lambda *a, device=None, **k: device is not None)
        if torch.cuda.is_initialized():  # and CUDA's count: a warning at every synchronising call
            self.caught = warnings.catch_warnings()
            shown = warnings.showwarning
            self.caught.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = lambda msg, *a, **k: (
                self.note(cuda=True) if CUDA_SYNC in str(msg) else shown(msg, *a, **k))
            torch.cuda.set_sync_debug_mode(1)
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)
        self.saved.clear()
        self.count = sum(self.sites.values())
        if self.caught:
            torch.cuda.set_sync_debug_mode(0)
            self.caught.__exit__(*exc)
            self.caught = None
            self.cuda = sum(self.cuda_sites.values())
        return super().__exit__(*exc)

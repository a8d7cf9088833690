"""A model's weights moved onto 2 MiB pages (Linux transparent huge pages, asked for with madvise).

Decoding a few sequences reads every weight once a step. On 4 KiB pages that read walks a page table entry per
4 KiB and the TLB misses slow it: on a 2-core Zen 4 VM a sum over 512 MiB read 56-59 GB/s on 4 KiB pages and
63-68 GB/s on 2 MiB pages (both ~35 GB/s when the VM's memory is in its slow mode), and with its weights moved the
engine decoded one sequence 1.14x faster in bf16 and 1.12x in int4, batched steps unchanged
(benchmarks/engine_ab.py --change huge_page_weights). Linux gives huge pages to a region only where
`transparent_hugepage` is `always` or `madvise` (the usual default); elsewhere the move costs a copy and changes
nothing.

The tensors moved are a model's dense CPU tensors of at least MIN_BYTES that own their whole storage: its
parameters and buffers, and the tensors its layers keep as plain attributes (packed, 4-bit and int8 weights,
their scales). oneDNN's prepacked tensors (opaque) and views into a larger storage stay where they are.
"""
import ctypes
import logging
import sys

import torch
from torch import nn

log = logging.getLogger(__name__)

PAGE = 2 << 20
ALIGN = 64  # each tensor's start in the arena: a cache line
MIN_BYTES = 64 << 10
MADV_HUGEPAGE = 14  # linux/mman.h


def move_weights(model: nn.Module, min_bytes: int | None = None) -> int:
    """Copies `model`'s movable tensors (see above) into one arena madvised for huge pages and points the model at
    the copies; returns the bytes moved (0 where madvise is refused: the model is left as it was). A tensor
    shared by two modules (tied embeddings) is moved once and stays shared. Call `replan()` on a model that bound
    its tensors into ops before."""
    owners = _movable(model, MIN_BYTES if min_bytes is None else min_bytes)
    if not owners:
        return 0
    offsets, total = {}, 0
    for key, (tensor, _) in owners.items():
        offsets[key], total = total, total + -(-tensor.nbytes // ALIGN) * ALIGN
    if (arena := huge_page_bytes(total)) is None:
        return 0
    for key, (tensor, places) in owners.items():
        flat = arena[offsets[key]:offsets[key] + tensor.nbytes].view(tensor.dtype)
        flat.copy_(tensor.view(-1))
        for module, name, shape in places:
            copy = flat.view(shape)
            if name in module._parameters:
                module._parameters[name].data = copy
            elif name in module._buffers:
                module._buffers[name] = copy
            else:
                setattr(module, name, copy)
    granted = min(total, int(mapping(arena.data_ptr()).get("AnonHugePages", "0 kB").split()[0]) * 1024)
    log.info("weights moved for 2 MiB pages: %d tensors, %.1f MB, %.1f MB of it on huge pages (the kernel gives "
             "them where it has whole free 2 MiB pages)", len(owners), total / 1e6, granted / 1e6)
    return total


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """An uninitialised uint8 tensor of nbytes starting on a 2 MiB boundary, its pages madvised for huge pages
    (each is given as it is first written); None where madvise is refused."""
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    if not _madvise_huge(raw.data_ptr() + start, -(-nbytes // PAGE) * PAGE):
        return None
    return raw[start:start + nbytes]


def mapping(address: int) -> dict[str, str]:
    """The fields of this process's /proc/self/smaps entry for the mapping that holds address ({} where there is
    none, or no smaps): "AnonHugePages" (its bytes on huge pages), "VmFlags" ("hg": madvised for them), ..."""
    fields, inside = {}, False
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return {}
    for line in lines:
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
            if inside:
                break
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
        elif inside:
            fields[head[:-1]] = rest.strip()
    return fields


Places = list[tuple[nn.Module, str, torch.Size]]  # (module, attribute, shape) holding the same bytes


def _movable(model: nn.Module, min_bytes: int) -> dict[int, tuple[torch.Tensor, Places]]:
    """data_ptr -> (tensor, the (module, attribute, shape) places that hold it or a view of the same bytes)."""
    owners: dict[int, tuple[torch.Tensor, Places]] = {}
    for module in model.modules():
        named = {**vars(module), **module._parameters, **module._buffers}
        for name, t in named.items():
            if not isinstance(t, torch.Tensor) or not _owns_storage(t) or t.nbytes < min_bytes:
                continue
            entry = owners.setdefault(t.data_ptr(), (t, []))
            if entry[0].dtype == t.dtype:  # else (the same bytes as another dtype) it stays where it is
                entry[1].append((module, name, t.shape))
    return owners


def _owns_storage(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes)


def _madvise_huge(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) != 0:
        log.info("madvise(MADV_HUGEPAGE) refused (errno %d): weights stay on the default pages", ctypes.get_errno())
        return False
    return True

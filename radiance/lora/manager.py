"""LoraManager: the adapters an engine knows, those kept loaded (an LRU of max_cpu_loras) and the max_loras slots of
the model's LoraLinears they are copied into when a scheduled sequence needs them.

The scheduler asks `admits` before it admits a waiting sequence: a step holds at most max_loras distinct adapters,
counting those of every running sequence (a sequence that would bring one more waits; it does not fail), and
`activate` then gives the sequence its adapter's slot, copying the adapter in if it is not resident (into a free
slot, or one whose adapter no running sequence uses). An adapter a waiting or running sequence refers to is never
dropped from memory, so admission never reads a file.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict

import torch

from radiance.formats import DenseWeight
from radiance.lora.adapter import LoraAdapter, LoraTarget, load_adapter
from radiance.lora.layers import install_lora_layers
from radiance.lora.request import LoRARequest

logger = logging.getLogger(__name__)

NO_SLOT = -1


class LoraManager:
    def __init__(self, config, model, device: torch.device, dtype: torch.dtype):
        """`config`: radiance.config.LoraConfig (enable_lora set)."""
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_loras = config.max_loras
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.context, self.layers = install_lora_layers(model, config.max_loras, config.max_lora_rank, dtype, device)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no attention or dense MLP linears to put LoRA adapters on")
        self.targets = {name: LoraTarget(layer.in_features, layer.partitions) for name, layer in self.layers.items()}
        self._lock = threading.RLock()  # add / remove / list may come from the server's threads
        self.registered: dict[int, LoRARequest] = {}  # what list_loras shows
        self.loaded: OrderedDict[int, LoraAdapter] = OrderedDict()  # least recently used first
        self.refs: Counter[int] = Counter()  # unfinished sequences per adapter id
        self.slot_owner: list[int | None] = [None] * self.max_loras  # adapter id resident in each slot
        self._slot_lru: list[int] = list(range(self.max_loras))  # least recently activated first

    # ---------------------------------------------------------------- adapters

    def load(self, request: LoRARequest) -> LoraAdapter:
        """Reads and checks an adapter (any thread; nothing registered): ValueError naming the file and tensor."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        return load_adapter(request, self.targets, self.config.max_lora_rank, self._scale_b)

    def _scale_b(self, name: str, partition: int | None, b: torch.Tensor) -> torch.Tensor:
        """What the model does to this linear's weight at load (Granite's residual multiplier, Llama 4's q / k row
        order) done to B: one partition's B (or all of them, fused) placed in the merged linear's rows for it."""
        sizes = self.targets[name].partitions
        if partition is None:
            return self.model.checkpoint_linear(name, DenseWeight(b, tuple(sizes))).tensor.float()
        start = sum(sizes[:partition])
        merged = b.new_zeros(sum(sizes), b.shape[1])
        merged[start:start + sizes[partition]] = b
        done = self.model.checkpoint_linear(name, DenseWeight(merged, tuple(sizes))).tensor.float()
        return done[start:start + sizes[partition]]

    def add(self, request: LoRARequest, adapter: LoraAdapter | None = None) -> bool:
        """Registers (and loads, unless `adapter` is given) an adapter; False when its id is already registered."""
        with self._lock:
            if request.lora_int_id in self.registered:
                return False
        adapter = adapter if adapter is not None else self.load(request)
        with self._lock:
            if request.lora_int_id in self.registered:
                return False
            self.registered[request.lora_int_id] = request
            self._keep(adapter)
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", request.lora_name, request.lora_int_id,
                    adapter.rank, adapter.path)
        return True

    def has(self, lora_int_id: int) -> bool:
        with self._lock:
            return lora_int_id in self.registered

    def remove(self, lora_int_id: int) -> bool:
        """Unregisters an adapter (False if unknown). Sequences already using it finish with it."""
        with self._lock:
            if self.registered.pop(lora_int_id, None) is None:
                return False
            if not self.refs[lora_int_id]:
                self.loaded.pop(lora_int_id, None)
                self._forget_slot(lora_int_id)
            return True

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return list(self.registered.values())

    def resolve(self, request: LoRARequest) -> LoRARequest:
        """The registered request a sequence runs with, loading a new one from its path; ValueError when the
        adapter is unknown or cannot be loaded."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a radiance.LoRARequest, got {type(request).__name__}")
        with self._lock:
            known = self.registered.get(request.lora_int_id)
        if known is None:
            if not request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) is not loaded, "
                                 "and the request gives no lora_path to load it from")
            self.add(request)
            return self.registered[request.lora_int_id]
        with self._lock:
            if request.lora_int_id not in self.loaded:  # dropped from memory since: read again
                adapter = self.load(known)
                self._keep(adapter)
        return known

    def acquire(self, lora_int_id: int) -> bytes:
        """A new sequence uses the adapter (kept in memory until `release`); its fingerprint for the prefix cache."""
        with self._lock:
            if lora_int_id not in self.registered:
                raise ValueError(f"LoRA adapter id {lora_int_id} was removed")
            self.refs[lora_int_id] += 1  # first: the trim that keeping it makes must not drop it
            if lora_int_id not in self.loaded:  # dropped from memory since it was resolved (another adapter's load)
                try:
                    self._keep(self.load(self.registered[lora_int_id]))
                except Exception:
                    self.refs[lora_int_id] -= 1
                    raise
            adapter = self.loaded[lora_int_id]
            self.loaded.move_to_end(lora_int_id)
            return adapter.fingerprint

    def release(self, lora_int_id: int) -> None:
        with self._lock:
            self.refs[lora_int_id] -= 1
            if self.refs[lora_int_id] <= 0:
                del self.refs[lora_int_id]
                if lora_int_id not in self.registered:  # removed while in use
                    self.loaded.pop(lora_int_id, None)
                    self._forget_slot(lora_int_id)
                self._trim()

    def _keep(self, adapter: LoraAdapter) -> None:
        """Into the LRU (weights converted to the serving dtype once), trimmed to max_cpu_loras."""
        adapter.weights = {name: [None if p is None else (p[0].to(self.dtype), p[1].to(self.dtype)) for p in parts]
                           for name, parts in adapter.weights.items()}
        lora_id = adapter.request.lora_int_id
        if lora_id in self.loaded and self.loaded[lora_id].fingerprint != adapter.fingerprint:
            self._forget_slot(lora_id)  # new contents under the id: its slot copy is stale
        self.loaded[lora_id] = adapter
        self.loaded.move_to_end(lora_id)
        self._trim()

    def _trim(self) -> None:
        """Drops least recently used adapters no sequence refers to while more than max_cpu_loras are loaded (they
        stay registered: the next request reads them again)."""
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                return
            if not self.refs[lora_id]:
                del self.loaded[lora_id]
                self._forget_slot(lora_id)

    def _forget_slot(self, lora_int_id: int) -> None:
        for slot, owner in enumerate(self.slot_owner):
            if owner == lora_int_id:
                self.slot_owner[slot] = None  # contents left in place: no step reads the slot until it is refilled

    # ---------------------------------------------------------------- scheduling

    @staticmethod
    def step_adapters(running) -> set[int]:
        """The adapters of the running sequences: they hold their slots."""
        return {seq.lora_int_id for seq in running if seq.lora_int_id}

    def admits(self, seq, active: set[int]) -> bool:
        """Whether `seq` may join sequences that use the adapters `active` (max_loras distinct ones at most)."""
        lora_id = seq.lora_int_id
        return not lora_id or lora_id in active or len(active) < self.max_loras

    def activate(self, seq, active: set[int]) -> None:
        """Gives an admitted sequence its adapter's slot (seq.lora_slot), copying the adapter into a slot no adapter
        in `active` holds when it is not resident."""
        lora_id = seq.lora_int_id
        if not lora_id:
            seq.lora_slot = NO_SLOT
            return
        with self._lock:
            if lora_id in self.slot_owner:
                slot = self.slot_owner.index(lora_id)
            else:
                slot = next((s for s in self._slot_lru if self.slot_owner[s] is None), None)
                if slot is None:
                    slot = next(s for s in self._slot_lru if self.slot_owner[s] not in active)
                adapter = self.loaded[lora_id]
                for name, layer in self.layers.items():
                    layer.set_slot(slot, adapter.weights.get(name))
                self.slot_owner[slot] = lora_id
            self._slot_lru.remove(slot)
            self._slot_lru.append(slot)
        seq.lora_slot = slot

"""A prefix cache across requests for the block-diffusion families (SDAR, LLaDA2.x): exact reuse.

A prompt's whole blocks are prefilled block-causally: the keys/values of block i depend only on
the tokens of blocks 0..i (and the block length, which shapes the mask). So they are keyed by a
hash chain, key_i = H(key_{i-1}, tokens of block i), rooted in H(cache_salt, block length), and
a later request whose prompt starts with the same blocks copies them into its slot's cache and
prefills only the rest. The copy is the very bits a cold prefill computes: a prefill runs one
part per block, whose queries attend unmasked over exactly the keys the block sees
(`BlockRunner._parts`), and every GEMM has a row count that is a multiple of `moe.ROW_ALIGN`, so
a block's keys/values depend neither on the chunk it was computed in nor on the rows beside it
(tests/unit/models/test_prefix_cache.py checks it bitwise, and token for token).

Entries are one tensor per block, (layers, 2, Hk, b, Dh), shared read-only (copied into a slot,
never attended in place), evicted least recently used under a byte budget. `cache_salt` (vLLM's
name) roots a tenant's chain apart: tenants with different salts never share an entry, so the
time to first token cannot reveal another tenant's prompt. Only the prompt's whole blocks are
cached; generated blocks are not (a later turn re-tokenizes its history anyway).
The full-canvas families attend bidirectionally, so no position's keys/values are a function of
its prefix alone: they get no prefix cache (docs/prefix-cache.md).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

ROOT = b"celeris-prefix-v1"


def chain(tokens: Seq[int], block: int, salt: str = "") -> list[bytes]:
    """The keys of the whole blocks of `tokens`: key i names blocks 0..i under this salt."""
    h = hashlib.blake2b(ROOT + salt.encode() + b"\0" + block.to_bytes(4, "little"), digest_size=16).digest()
    keys = []
    for start in range(0, len(tokens) - len(tokens) % block, block):
        body = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start:start + block])
        h = hashlib.blake2b(h + body, digest_size=16).digest()
        keys.append(h)
    return keys


@dataclass(frozen=True)
class CacheStats:
    """Counters since start, and what is held now (telemetry reads it)."""

    queried_tokens: int  # prompt tokens of requests that asked the cache
    hit_tokens: int  # of them, served from it
    bytes_used: int
    budget_bytes: int
    entries: int
    evictions: int


class PrefixCache:
    """Block keys -> (layers, 2, Hk, b, Dh) tensors, LRU under `budget_bytes`. Thread-safe (the
    step thread writes, telemetry reads)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes_used = 0
        self.evictions = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Seq[bytes], limit: int) -> list[torch.Tensor]:
        """The entries of the longest cached run keys[0], keys[1], ... (at most `limit`), each
        made most recently used."""
        found = []
        with self._lock:
            for key in keys[:limit]:
                entry = self._entries.get(key)
                if entry is None:
                    break
                self._entries.move_to_end(key)
                found.append(entry)
        return found

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self.queried_tokens += prompt_tokens
            self.hit_tokens += hit_tokens

    def insert(self, key: bytes, entry: torch.Tensor) -> None:
        """Hold `entry` (owned by the cache from now on) under `key`, evicting the least recently
        used entries to stay within the budget; an entry larger than the budget is not held."""
        size = entry.numel() * entry.element_size()
        if size > self.budget_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self.bytes_used + size > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes_used -= old.numel() * old.element_size()
                self.evictions += 1
            self._entries[key] = entry
            self.bytes_used += size

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes_used = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.queried_tokens, self.hit_tokens, self.bytes_used, self.budget_bytes,
                              len(self._entries), self.evictions)


def budget_from_gb(gb: Optional[float]) -> int:
    """Bytes of a `--prefix-cache-gb` setting (GiB; fractions allowed, 0 turns the cache off)."""
    return 0 if not gb else int(gb * 2**30)


class SlotPrefixes:
    """The block runner's side of the cache: a loaded slot gets its prompt's cached blocks
    copied in (the request then prefills only the rest), and each prefill chunk's blocks are
    offered to the cache. `store` is the runner's `cache.BlockKVStore`: per layer (slots, Hk, W, Dh)."""

    def __init__(self, cache: PrefixCache, store):
        self.cache, self.store = cache, store

    def load(self, seq) -> None:
        """Copy the longest cached run of seq's whole prompt blocks into its slot."""
        b = seq.params.block_length
        whole = seq.first_block * b
        seq.prefix_keys = chain(seq.prompt[:whole], b, seq.cache_salt)
        found = self.cache.lookup(seq.prefix_keys, len(seq.prefix_keys))
        hit = len(found) * b
        if found:
            kv = torch.cat(found, dim=3)  # (layers, 2, Hk, hit, Dh)
            for layer, (K, V) in enumerate(zip(self.store.keys, self.store.values)):
                K[seq.slot, :, :hit] = kv[layer, 0]
                V[seq.slot, :, :hit] = kv[layer, 1]
            seq.skip_prefill(hit)
        self.cache.record(len(seq.prompt), hit)

    def offer(self, seqs) -> None:
        """After a prefill forward: hold the prompt blocks of each row's chunk that the cache
        lacks. Their keys/values were written in place at the slot's columns by that forward (a
        first block that joined decoding holds provisional ones: never offered)."""
        for s in seqs:
            start, end = s.prefill_window
            b = s.params.block_length
            new = [i for i in range(start // b, end // b) if not self.cache.has(s.prefix_keys[i])]
            if not new:
                continue
            lo, hi = new[0] * b, (new[-1] + 1) * b
            kv = torch.stack([torch.stack([K[s.slot, :, lo:hi], V[s.slot, :, lo:hi]])
                              for K, V in zip(self.store.keys, self.store.values)])  # (layers, 2, Hk, hi-lo, Dh)
            for i in new:
                a = i * b - lo
                self.cache.insert(s.prefix_keys[i], kv[:, :, :, a:a + b].clone())


DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # 1 GiB; `--prefix-cache-gb` sets it


def slot_prefixes(config, store, device: torch.device) -> Optional[SlotPrefixes]:
    """The block runner's prefix cache under `config.prefix_cache_bytes` (None: on by default on
    the CPU only, where the bitwise equality of cached and cold prefills is tested; CUDA GEMMs
    pick kernels by row count, so there it is on only when asked for: docs/prefix-cache.md)."""
    budget = config.prefix_cache_bytes
    if budget is None:
        budget = DEFAULT_PREFIX_CACHE_BYTES if device.type == "cpu" else 0
    return SlotPrefixes(PrefixCache(budget), store) if budget > 0 else None

"""Lesson 29: offloading KV to host memory — a prefix the device evicted, found in host memory and loaded back."""
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine.trace_names import BATCH, KV_LOAD, KV_SAVE, KV_TRANSFER, MODEL_RUNNER
from lessons.cli import main
from lessons.framework import events_of, greedy, kv_blocks, queue_request, table

TITLE = "Offloading KV to host memory"
SUMMARY = ("A small device KV cache with host memory behind it (--kv-offloading-size, V1's OffloadingConnector): "
           "every full block copied to host memory as it is written, a shared prefix evicted from the device by "
           "other prompts and found in host memory, loaded back layer by layer instead of computed, the same "
           "output, and the load's time against recomputing the prefix, measured.")
BLOCK, DEVICE_BLOCKS, HOST_GIB, MAX_NEW, REPS = 16, 24, 0.01, 8, 3
DOCUMENT = ("The paged KV cache keeps the keys and values of every token in fixed-size blocks. A block table maps "
            "each request's logical blocks to physical ones, so requests grow without copying and share the blocks "
            "of a common prefix. When the pool runs out of free blocks, the least recently used cached block is "
            "evicted and its keys and values are gone, unless a second tier keeps a copy. ")
QUESTION = "Question: what happens to an evicted block?"
OTHERS = [f"Another document, number {i}, read backwards: " + DOCUMENT[::-1][:280] for i in range(4)]


def run(lesson) -> None:
    lesson.intro(
        "The device's KV cache is small and fast; host memory is large and slower. vLLM's **OffloadingConnector** "
        "(`--kv-offloading-size GiB`, `vllm/v1/kv_offload/`) puts host memory behind the device's cache: every "
        "full block is copied there as it is computed, keyed by the same prefix-cache hash, and a prefix the "
        "device has evicted is loaded back from there instead of computed again. It is a KV connector like the "
        "one that moves blocks between instances (lesson 28): `get_num_new_matched_tokens` answers how many "
        f"tokens host memory holds, the worker copies them in layer by layer. This lesson gives the device only "
        f"{DEVICE_BLOCKS - 1} usable blocks of {BLOCK} tokens, so a few prompts are enough to evict one.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=DEVICE_BLOCKS, kv_offloading_size=HOST_GIB)
    plain, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=256, enable_prefix_caching=False)  # no cache at all
    first = the_tiers(lesson, llm, session)
    evicted(lesson, llm)
    found_in_host_memory(lesson, llm, session, plain, first)
    load_against_recompute(lesson, llm, session, plain)
    lesson.done(
        "With a host-memory tier every full block is copied out as it is written, so evicting it from the device "
        "loses nothing: a later request with the same prefix finds it in host memory (after the device's own "
        "prefix cache, which comes first), has it copied into fresh device blocks layer by layer before each "
        "layer's attention, and computes only the rest. The output is the same; what the prefix costs is a copy "
        "of its bytes instead of its forward pass.")


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _since(session, seq: int, layer: str, name: str, rid: str | None = None) -> list[dict]:
    return [e.attrs for e in events_of(session) if e.seq >= seq and (e.layer, e.name) == (layer, name)
            and (rid is None or e.request_id == rid)]


def _finish(llm, req) -> list[int]:
    """Step the engine until every request has finished; req's output tokens."""
    eng = llm.llm_engine
    while eng.has_unfinished_requests():
        eng.step()
    return list(req.output_token_ids)


def the_tiers(lesson, llm, session):
    core = _core(llm)
    connector = core.scheduler.connector
    caches = core.model_runner.kv_connector.kv_caches
    k, _ = next(iter(caches.values()))
    per_block = len(caches) * 2 * k[0].numel() * k.element_size()
    lesson.show(table(["tier", "blocks", "bytes per block", "holds"], [
        ["device (the paged KV cache)", f"{DEVICE_BLOCKS} (block 0 the null block)", f"{per_block:,}",
         f"{(DEVICE_BLOCKS - 1) * BLOCK} tokens"],
        ["host memory", connector.num_cpu_blocks, f"{per_block:,}", f"{connector.num_cpu_blocks * BLOCK:,} tokens"]],
        title=f"--kv-offloading-size {HOST_GIB} GiB"))
    lesson.check(connector.num_cpu_blocks == int(HOST_GIB * 2**30) // per_block,
                 f"host memory holds {HOST_GIB} GiB / {per_block:,} bytes = {connector.num_cpu_blocks} blocks: a host "
                 f"block holds every layer's K and V of one device block ({len(caches)} layers)")
    since = session.bus.next_seq
    first = queue_request(llm.llm_engine, "doc", DOCUMENT + QUESTION, greedy(MAX_NEW))
    tokens = _finish(llm, first)
    saved = sum(len(a["block_ids"]) for a in _since(session, since, KV_TRANSFER, KV_SAVE, "doc"))
    full = (first.num_prompt_tokens + MAX_NEW - 1) // BLOCK  # the last token is sampled, never computed
    lesson.check(saved == full,
                 f"request 'doc' ({first.num_prompt_tokens} prompt tokens + {MAX_NEW} generated) filled {full} blocks "
                 "and each was copied to host memory in the step that filled it (kv_transfer save events)")
    lesson.pause()
    return first, tokens


def evicted(lesson, llm) -> None:
    for i, text in enumerate(OTHERS):
        _finish(llm, queue_request(llm.llm_engine, f"other{i}", text, greedy(MAX_NEW)))
    lesson.show(kv_blocks(llm, width=DEVICE_BLOCKS), title="the device's blocks now (· cached and free)")
    lesson.say(f"{len(OTHERS)} other prompts needed the device's blocks: the free queue hands out the least "
               "recently used first, and a cached block handed out loses its hash.")
    lesson.pause()


def found_in_host_memory(lesson, llm, session, plain, first) -> None:
    core = _core(llm)
    doc, tokens = first
    pool, bs = core.kv_cache_manager.block_pool, BLOCK
    on_device = [pool.get_cached_block(h, tuple(doc.all_token_ids[i * bs:(i + 1) * bs]))
                 for i, h in enumerate(doc.block_hashes[:doc.num_prompt_tokens // bs])]
    lesson.check(all(b is None for b in on_device),
                 f"none of the document's {len(on_device)} full prompt blocks is in the device's prefix cache any more")
    hits_before = core.kv_cache_manager.prefix_cache_hits
    since = session.bus.next_seq
    again = queue_request(llm.llm_engine, "doc-again", DOCUMENT + QUESTION, greedy(MAX_NEW))
    tokens_again = _finish(llm, again)
    loads = _since(session, since, KV_TRANSFER, KV_LOAD, "doc-again")
    computed = [c for a in _since(session, since, MODEL_RUNNER, BATCH) for i, c in enumerate(_rows(a))
                if a["request_ids"][i] == "doc-again"]
    n, hit = again.num_prompt_tokens, (again.num_prompt_tokens - 1) // bs * bs
    lesson.show(table(["", "request 'doc'", "request 'doc-again'"], [
        ["prompt tokens", doc.num_prompt_tokens, n], ["from the device's prefix cache", 0,
                                                      core.kv_cache_manager.prefix_cache_hits - hits_before],
        ["from host memory", 0, again.num_cached_tokens],
        ["blocks loaded (kv_transfer load)", 0, sum(len(a["block_ids"]) for a in loads)],
        ["prompt tokens computed", doc.num_prompt_tokens, computed[0]]], title="the same prompt, evicted in between"))
    lesson.check(core.kv_cache_manager.prefix_cache_hits == hits_before and again.num_cached_tokens == hit
                 and sum(len(a["block_ids"]) for a in loads) == hit // bs,
                 f"the device's cache found nothing; host memory delivered {hit} tokens: every full block before "
                 f"the last prompt token ({hit // bs} blocks, loaded back into the request's new device blocks)")
    lesson.check(computed[0] == n - hit >= 1,
                 f"its prefill computed only the {n - hit} prompt tokens host memory did not deliver")
    want = plain.generate(DOCUMENT + QUESTION, greedy(MAX_NEW), use_tqdm=False)[0].outputs[0].token_ids
    lesson.check(tokens == tokens_again == list(want),
                 "the output is the same token for token: computed, loaded from host memory, and from an engine "
                 "without any cache")
    lesson.pause()


def load_against_recompute(lesson, llm, session, plain) -> None:
    lesson.say(f"What does the load save? The same prompt {REPS} times: its prefix evicted from the device "
               "(`reset_prefix_cache` empties the device's tier only) and loaded back from host memory, against an "
               "engine that computes it whole, interleaved; the first token's time is the prefill's.")
    load_ms, host_ms, cold_ms, nbytes = [], [], [], 0
    for _ in range(REPS):
        llm.reset_prefix_cache()
        since = session.bus.next_seq
        t0 = time.perf_counter()
        out = llm.generate(DOCUMENT + QUESTION, greedy(1), use_tqdm=False)[0]
        host_ms.append((time.perf_counter() - t0) * 1000)
        loads = _since(session, since, KV_TRANSFER, KV_LOAD, out.request_id)
        load_ms.append(sum(a["seconds"] for a in loads) * 1000)
        nbytes = sum(a["bytes"] for a in loads)
        t0 = time.perf_counter()
        plain.generate(DOCUMENT + QUESTION, greedy(1), use_tqdm=False)
        cold_ms.append((time.perf_counter() - t0) * 1000)
        lesson.check(out.num_cached_tokens > 0 and nbytes > 0, "the prefix came from host memory again")
    host, cold = statistics.median(host_ms), statistics.median(cold_ms)
    lesson.show(table(["KV bytes loaded", "load (ms)", "first token, prefix from host memory (ms)",
                       "first token, computed whole (ms)"],
                      [[f"{nbytes:,}", f"{statistics.median(load_ms):.2f}", f"{host:.1f}", f"{cold:.1f}"]],
                      title=f"medians of {REPS}, on this machine"))
    if host < cold:
        lesson.say(f"Here the first token came {cold / host:.1f}× sooner with the prefix from host memory. On a "
                   "GPU the copy crosses PCIe (vLLM runs it on its own CUDA streams, overlapped with compute).")
    else:
        lesson.say(f"Here the prefix from host memory gave no gain ({host:.1f} ms against {cold:.1f} ms): on a "
                   "CPU with a model this small, computing a few hundred tokens costs about as much as copying "
                   "their keys and values, and the step's fixed costs dominate both. `python -m "
                   "benchmarks.kv_transfer` measures longer prompts.")
    lesson.pause()


def _rows(batch: dict) -> list[int]:
    q = batch["query_start_loc"]
    return [q[i + 1] - q[i] for i in range(len(batch["request_ids"]))]


if __name__ == "__main__":
    raise SystemExit(main(globals()))

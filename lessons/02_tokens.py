"""Lesson 2: text -> token ids -> text, and why detokenisation is incremental."""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams  # noqa: E402
from lessons.framework import events_of, main, table  # noqa: E402

TITLE = "Tokens: text → ids → text"
SUMMARY = "Byte-level tokens, round trips, and why a streamed character must wait for all its bytes."
PROMPT = "Café 👋"
STEER = "é👋 世!"  # what we make the engine "generate", one byte-level token at a time
BAD = "\ufffd"  # U+FFFD, what a decoder prints for bytes that are not (yet) a whole character


def run(lesson) -> None:
    lesson.intro(
        "A model reads and writes **token ids**, not text. You will see a prompt become ids, see that "
        "one character can take several tokens, and then watch the real engine stream a reply token by "
        "token: a step whose token ends in the middle of a character streams **nothing**, and the "
        "character appears whole once its last byte arrives.")
    llm, session = lesson.engine(num_kv_blocks=16)
    engine = llm.llm_engine
    tok = engine.tokenizer
    byte_level = tok.encode("é") == list("é".encode("utf-8"))

    # ---- encode ----
    req = engine.add_request("A", PROMPT, SamplingParams(temperature=0, max_tokens=len(STEER.encode()),
                                                         ignore_eos=True))
    ids = req.prompt_token_ids
    enc = next(e for e in events_of(session) if e.layer == "tokenizer" and e.name == "encode")
    lesson.say(f"`add_request` tokenized the prompt `{PROMPT}` into {len(ids)} ids. Each id, alone:")
    vocab = tok.convert_ids_to_tokens(ids)
    lesson.show(table(["id", "vocabulary entry", "decoded alone"],
                      [[i, v, repr(p)] for i, v, p in zip(ids, vocab, enc.get("pieces"))],
                      title="the tokenizer's encode event"))
    if byte_level:
        lesson.say(
            f"This tokenizer is **byte-level** without merges: id *b* is the UTF-8 byte *b* (0–255), and "
            f"{len(tok) - 1} is `<|endoftext|>`. The vocabulary stores each byte as a printable stand-in "
            "(GPT-2's convention: a space is `Ġ`). GPT-2's real tokenizer adds ~50,000 BPE merges, so "
            "common words become one token, but rare characters still split into several.")
        lesson.check(ids == list(PROMPT.encode("utf-8")), "the prompt's ids are exactly its UTF-8 bytes")
        lesson.check(len(ids) == len(PROMPT) + 1 + 3, "'é' takes 2 tokens and '👋' 4, so 6 characters → 10 tokens")
    lesson.check(enc.get("token_ids") == ids, "the tracer's encode event carries the same ids the request holds")
    lesson.check(any(BAD in p for p in enc.get("pieces")),
                 "decoded one at a time, some ids are not text at all (U+FFFD, the replacement character)")
    lesson.pause()

    # ---- round trips on real text ----
    samples = {"this lesson's source": pathlib.Path(__file__).read_text(encoding="utf-8"),
               "the README": (ROOT / "README.md").read_text(encoding="utf-8"),
               "combining accent, ZWJ emoji, CJK": "e\u0301 👨‍👩‍👧 漢字\ttab\nnewline"}
    eot = tok.convert_ids_to_tokens(engine.eos_token_id)
    rows, all_ok, counts_ok = [], True, True
    for name, text in samples.items():
        t_ids = tok.encode(text, verbose=False)  # verbose=False: no warning about texts > 512 tokens
        back = tok.decode(t_ids)
        all_ok &= back == text
        n_bytes, n_eot = len(text.encode("utf-8")), text.count(eot)
        counts_ok &= len(t_ids) == n_bytes - n_eot * (len(eot) - 1)
        rows.append([name, len(text), n_bytes, n_eot, len(t_ids), back == text])
    lesson.show(table(["text", "characters", "UTF-8 bytes", f"'{eot}' in it", "tokens", "decode(encode(t)) == t"],
                      rows, title="round trips"))
    lesson.check(all_ok, "decode(encode(text)) gives back every text exactly")
    if byte_level:
        lesson.say(f"Tokens = bytes, except that the literal text `{eot}` becomes the one special id "
                   f"{engine.eos_token_id} instead of {len(eot)} byte tokens (Hugging Face tokenizers, "
                   "and so vLLM, parse special-token text in prompts by default).")
        lesson.check(counts_ok, f"tokens = UTF-8 bytes − {len(eot) - 1} × (occurrences of '{eot}')")
    lesson.pause()

    # ---- streaming: the engine's real detokenizer ----
    steer = list(STEER.encode("utf-8")) if byte_level else tok.encode(STEER)
    lesson.say(
        "Now the engine generates. The untrained model would only say ASCII, so we **steer its sampler**: "
        f"each step, after the model and sampler run, the chosen token is replaced by the next token of "
        f"`{STEER}`. Everything after that — appending the token, detokenizing, streaming — is the "
        "engine's own code.")
    sampler = engine.model_runner.sampler

    def steered(logits, requests):
        out = sampler(logits, requests)
        out.token_ids = [steer[r.num_output_tokens] if r.request_id == "A" else t
                         for r, t in zip(requests, out.token_ids)]
        return out

    engine.model_runner.sampler = steered
    lesson.predict(
        "After the steps that sample 0xF0 0x9F 0x91 — three of the four bytes of '👋' — what has the "
        "engine streamed to the client for those steps?",
        "Nothing: each of those steps streams the empty string. The step that samples the 4th byte, "
        "0x8B, streams '👋' whole.")
    rows, pieces, naive = [], [], ""
    while engine.has_unfinished_requests():
        engine.step()
        new = [e for e in events_of(session) if e.layer == "detokenizer" and e.name == "NEW_TOKENS"][-1]
        t = new.get("token_ids")[0]
        pieces.append(new.get("text"))
        naive += tok.decode([t])
        rows.append([new.step, f"{t} (0x{t:02X})", repr(new.get("text")), repr(req.output_text), repr(naive)])
    lesson.show(table(["step", "sampled token", "streamed this step", "output text", "decoding each token alone"],
                      rows, title="the detokenizer's NEW_TOKENS events, step by step"))
    # Steps whose token leaves the text ending mid-character (decoding the prefix ends in U+FFFD).
    waiting = sum(tok.decode(steer[:i + 1]).endswith(BAD) for i in range(len(steer)))
    lesson.check(req.output_token_ids == steer, f"the engine appended the {len(steer)} steered tokens")
    lesson.check(waiting > 0 and [p == "" for p in pieces] == [tok.decode(steer[:i + 1]).endswith(BAD)
                                                              for i in range(len(steer))],
                 f"exactly the {waiting} steps whose token ended mid-character streamed nothing")
    lesson.check(all(BAD not in p for p in pieces), "no streamed piece ever holds a broken character")
    lesson.check("".join(pieces) == req.output_text == STEER == tok.decode(req.output_token_ids),
                 "the streamed pieces add up to exactly decode(all output ids)")
    lesson.check(BAD in naive, "decoding each token alone would have streamed U+FFFD garbage instead")
    lesson.say(
        "The engine's `IncrementalDetokenizer` wraps the `tokenizers` library's `DecodeStream`: it keeps "
        "the tokens it cannot yet turn into whole text and returns new text only when it is complete. "
        "vLLM V1 does the same in its front-end process (its fast incremental detokenizer is built on "
        "`DecodeStream`), and checks stop strings on that text.")
    lesson.done(
        "Text becomes ids on the way in (here one id per UTF-8 byte), and ids become text on the way "
        "out. Decoding cannot be done one token at a time: a character may span several tokens, so the "
        "detokenizer holds back incomplete bytes and streams each character once it is whole. Decoding "
        "everything at the end gives the same text.")


if __name__ == "__main__":
    sys.exit(main(globals()))

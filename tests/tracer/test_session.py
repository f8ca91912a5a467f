import io

from engine import LLM, Hooks, SamplingParams
from tracer.events import read_trace
from tracer.session import TraceSession


def test_session_wires_bus_state_recorder_log_and_closes_cleanly(tmp_path):
    hooks, log = Hooks(), io.StringIO()
    session = TraceSession(hooks, trace_file=tmp_path / "t.jsonl", trace_log=log, layers=["engine"],
                           model="tiny-gpt2", engine_config={"block_size": 4})
    llm = LLM("tiny-gpt2", hooks=hooks, block_size=4)
    llm.generate("hi", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert session.state.view().finished == ["0"]
    session.close()
    session.close()
    assert not hooks.active  # detached: the engine is back to one attribute check per trace point
    header, events = read_trace(tmp_path / "t.jsonl")
    assert header["model"] == "tiny-gpt2" and events[0].name == "config"
    lines = log.getvalue().splitlines()
    assert lines and all(line.startswith("[TRACE] engine ") for line in lines)
    assert any(" FINISHED " in line and "finish_reason=length" in line for line in lines)

"""RequestOutputCollector (vLLM V1's): one pending item per request; a newer cumulative output
replaces an unread one, an exception replaces any output and is never replaced."""
import asyncio

from engine.engine.output_processor import RequestOutputCollector
from engine.outputs import CompletionOutput, RequestOutput


def _out(n: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "x" * n, list(range(n)), None, "length" if finished else None)
    return RequestOutput("r", None, [1], [completion], finished)


def test_the_newest_output_replaces_those_not_read_yet():
    async def go():
        c = RequestOutputCollector()
        for n in (1, 2, 3):
            c.put(_out(n))
        assert (await c.get()).outputs[0].token_ids == [0, 1, 2]
        c.put(_out(4, finished=True))
        last = await c.get()
        assert last.finished and len(last.outputs[0].token_ids) == 4
    asyncio.run(go())


def test_an_error_replaces_a_pending_output_and_stays():
    async def go():
        c = RequestOutputCollector()
        c.put(_out(1))
        c.put(RuntimeError("engine core died"))
        c.put(_out(2))
        assert isinstance(await c.get(), RuntimeError)
    asyncio.run(go())


def test_get_waits_for_the_next_put():
    async def go():
        c = RequestOutputCollector()
        task = asyncio.ensure_future(c.get())
        await asyncio.sleep(0.01)
        assert not task.done()
        c.put(_out(1))
        assert (await task).outputs[0].token_ids == [0]
        later = asyncio.ensure_future(c.get())  # taken: the next get waits again
        await asyncio.sleep(0.01)
        assert not later.done()
        later.cancel()
    asyncio.run(go())

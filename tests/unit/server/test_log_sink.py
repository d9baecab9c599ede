"""server.telemetry.SafeSink: whole log lines, one write each, whatever the threads.

`print` writes a record and its newline as two calls; on an unbuffered stdout (PYTHONUNBUFFERED,
as the images set) each is a system call, so another thread's or process's line could land
between them and merge two JSON records into one line (seen in a local full run under load: "Extra data" at column 109).
"""

import json
import threading

from celeris.server.telemetry import SafeSink


class Recorder:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_printed_line_is_one_write():
    out = Recorder()
    sink = SafeSink(out)
    print('{"event": "a"}', file=sink, flush=True)
    sink.write("two\nlines\n")
    sink.write("half ")
    sink.write("and half\nand a rest")
    assert out.writes == ['{"event": "a"}\n', "two\nlines\n", "half and half\n"]


def test_a_thread_between_a_record_and_its_newline_cannot_merge_lines():
    out = Recorder()
    sink = SafeSink(out)
    half_written, other_done = threading.Event(), threading.Event()

    def first():
        sink.write('{"thread": 1}')  # print's first call: the record, no newline yet
        half_written.set()
        other_done.wait(5)
        sink.write("\n")

    def second():
        half_written.wait(5)
        print('{"thread": 2}', file=sink)
        other_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out.writes == ['{"thread": 2}\n', '{"thread": 1}\n']
    assert all(json.loads(w) for w in out.writes)

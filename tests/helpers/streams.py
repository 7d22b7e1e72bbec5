"""Work run on several CUDA streams at once, for the split-K tile counters' tests: each job on a
stream of its own, queued behind a sleep on that stream so that the jobs' kernels are all waiting
when the sleeps end, and run at once instead of one after the other as the host queues them."""

import threading

import torch

SLEEP_CYCLES = 1 << 27  # ~80 ms at 1.7 GHz: longer than the host takes to queue the calls


def on_streams(jobs, streams, repeats: int) -> list[list[torch.Tensor]]:
    """Each job (a callable returning a tensor) called `repeats` times on its stream, from this
    thread, the calls of all jobs interleaved -> each job's outputs (copies, in call order)."""
    outs = [[] for _ in jobs]
    torch.cuda.synchronize()
    for stream in streams:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
    for _ in range(repeats):
        for job, stream, out in zip(jobs, streams, outs):
            with torch.cuda.stream(stream):
                out.append(job().clone())
    torch.cuda.synchronize()
    return outs


def on_threads(jobs, streams, repeats: int, warm_up: int = 0, serial: list | None = None) -> list[list[torch.Tensor]]:
    """The same, each job called from a Python thread of its own (its stream that thread's current
    one). First each thread calls its job warm_up times, one thread after the other (a function
    compiled with mode="reduce-overhead" and first called there records its CUDA graph in that
    thread's tree), then all at once. serial: a list that gets each job's last warm-up output."""
    outs = [[] for _ in jobs]
    errors = []
    turns = [threading.Event() for _ in range(len(jobs) + 1)]
    start = threading.Barrier(len(jobs))
    turns[0].set()

    def work(i):
        try:
            turns[i].wait()
            try:
                with torch.cuda.stream(streams[i]):
                    for _ in range(warm_up):
                        y = jobs[i]().clone()
                streams[i].synchronize()
                if serial is not None:
                    serial.append(y)  # (the threads warm up in turn: in job order)
            finally:
                turns[i + 1].set()
            start.wait()
            with torch.cuda.stream(streams[i]):
                torch.cuda._sleep(SLEEP_CYCLES)
                for _ in range(repeats):
                    outs[i].append(jobs[i]().clone())
            streams[i].synchronize()
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return outs

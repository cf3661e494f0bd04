"""How fast a window's rows come out of a shared-memory file while another thread runs Python (GB/s).

Emulates collect_dataset's copying thread: a 128 MiB file in /dev/shm written by another
process, mapped per take, 512 KiB windows (128 rows of 2048 bfloat16) copied into a reused
shard buffer on a thread, while the main thread runs Python (as the client's engine-driving
thread does). Run: python benchmarks/shm_copy.py
"""

import mmap
import os
import subprocess
import sys
import threading
import time

import torch

SIZE = 128 << 20
WINDOW = 128 * 2048 * 2
PATH = "/dev/shm/vle-copybench.rows"
MADV_POPULATE_READ = 22
TAKES = 4


def write_file():
    code = (
        "import torch,os;"
        f"fd=os.open('{PATH}',os.O_RDWR|os.O_CREAT,0o600);os.posix_fallocate(fd,0,{SIZE});"
        f"t=torch.from_file('{PATH}',shared=True,size={SIZE},dtype=torch.uint8);t.fill_(3)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def mapped(flags, prot=mmap.PROT_READ | mmap.PROT_WRITE):
    fd = os.open(PATH, os.O_RDONLY)
    try:
        view = mmap.mmap(fd, SIZE, flags=flags, prot=prot)
    finally:
        os.close(fd)
    return view


def take_mapped(dest, flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, advise=False):
    view = mapped(flags, prot)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = torch.frombuffer(view, dtype=torch.uint8)
    for start in range(0, SIZE, WINDOW):
        if advise:
            view.madvise(MADV_POPULATE_READ, start, WINDOW)
        dest[start : start + WINDOW].copy_(source[start : start + WINDOW])
    del source
    view.close()


def take_pread(dest, staging=None):
    fd = os.open(PATH, os.O_RDONLY)
    array = dest.numpy()
    try:
        for start in range(0, SIZE, WINDOW):
            if staging is None:
                os.preadv(fd, [memoryview(array[start : start + WINDOW])], start)
            else:
                os.preadv(fd, [memoryview(staging.numpy())], start)
                dest[start : start + WINDOW].copy_(staging)
    finally:
        os.close(fd)


def take_pread_fresh(dest):
    fd = os.open(PATH, os.O_RDONLY)
    try:
        for start in range(0, SIZE, WINDOW):
            staging = torch.empty(WINDOW, dtype=torch.uint8)
            os.preadv(fd, [memoryview(staging.numpy())], start)
            dest[start : start + WINDOW].copy_(staging)
    finally:
        os.close(fd)


def take_foreach(dest, flags=mmap.MAP_PRIVATE):
    view = mapped(flags)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = torch.frombuffer(view, dtype=torch.uint8)
    starts = range(0, SIZE, WINDOW)
    torch._foreach_copy_([dest[s : s + WINDOW] for s in starts], [source[s : s + WINDOW] for s in starts])
    del source
    view.close()


def take_scatter(dest):
    fd = os.open(PATH, os.O_RDONLY)
    array = dest.numpy()
    try:
        views = [memoryview(array[start : start + WINDOW]) for start in range(0, SIZE, WINDOW)]
        done = 0
        for first in range(0, len(views), 512):
            done += os.preadv(fd, views[first : first + 512], first * WINDOW)
        assert done == SIZE
    finally:
        os.close(fd)


def switching(take, interval):
    def run(dest):
        before = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        try:
            take(dest)
        finally:
            sys.setswitchinterval(before)
    return run


def busy(stop):
    count = 0
    while not stop.is_set():
        count += sum(range(200))


def measure(name, take, fresh=False, threads=None, contend=True):
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    dest = torch.empty(SIZE, dtype=torch.uint8)
    dest.fill_(0)
    stop = threading.Event()
    spinner = threading.Thread(target=busy, args=(stop,), daemon=True)
    if contend:
        spinner.start()
    times = []
    for _ in range(TAKES):
        if fresh:
            dest = torch.empty(SIZE, dtype=torch.uint8)
        box = []
        worker = threading.Thread(target=lambda: box.append(time.perf_counter()) or take(dest) or box.append(time.perf_counter()))
        worker.start()
        worker.join()
        times.append(box[1] - box[0])
    stop.set()
    if contend:
        spinner.join()
    torch.set_num_threads(before)
    best = min(times)
    middle = sorted(times)[len(times) // 2]
    print(f"{name:34s} median {SIZE / middle / 1e9:6.2f} GB/s  best {SIZE / best / 1e9:6.2f} GB/s", flush=True)


def main():
    print(os.uname().release, "cpus", os.cpu_count(), "torch threads", torch.get_num_threads())
    for knob in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            print(knob, open(knob).read().strip())
        except OSError as error:
            print(knob, error)
    write_file()
    private = mmap.MAP_PRIVATE
    populate = getattr(mmap, "MAP_POPULATE", 0x8000)
    measure("private (today)", lambda d: take_mapped(d, private))
    measure("private, no spinning thread", lambda d: take_mapped(d, private), contend=False)
    measure("private, 1 torch thread", lambda d: take_mapped(d, private), threads=1)
    measure("private + MAP_POPULATE", lambda d: take_mapped(d, private | populate))
    measure("private, switch interval 1 ms", switching(lambda d: take_mapped(d, private), 1e-3))
    measure("private, switch interval 0.1 ms", switching(lambda d: take_mapped(d, private), 1e-4))
    measure("private, one _foreach_copy_", take_foreach)
    measure("one _foreach_copy_, switch 0.1 ms", switching(take_foreach, 1e-4))
    measure("one preadv per 512 windows", take_scatter)
    os.unlink(PATH)


if __name__ == "__main__":
    main()

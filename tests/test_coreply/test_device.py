"""coreply.device: device names, thread counts, and one-off work on a thread of its own."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from threadpoolctl import threadpool_info

from coreply.device import check_device_name, on_own_thread, one_openmp_thread, set_threads


def test_device_names_are_checked_without_looking_at_the_host():
    for name in ("auto", "cpu", "cuda", "cuda:1"):
        assert check_device_name(name) == name
    for name in ("gpu", "cpu:0", "cuda:x", ""):
        with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N"):
            check_device_name(name)


def test_one_off_work_runs_on_a_thread_that_ends_with_it():
    seen = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x + 1

    assert on_own_thread(work, 1) == 2
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails() -> None:
        raise KeyError("the caller sees it")

    with pytest.raises(KeyError, match="the caller sees it"):
        on_own_thread(fails)


def test_set_threads_sets_torchs_threads_and_holds_numpys_blas_to_one():
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            set_threads(n)
            blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
            assert torch.get_num_threads() == n and blas and set(blas) == {1}
    finally:
        set_threads(before)


def test_one_openmp_thread_holds_only_the_thread_it_runs_on():
    before = torch.get_num_threads()
    try:
        set_threads(2)
        with ThreadPoolExecutor(1, initializer=one_openmp_thread) as helper:
            assert helper.submit(torch.get_num_threads).result() == 1
        with ThreadPoolExecutor(1) as plain:  # a new thread without it takes the process's count
            assert plain.submit(torch.get_num_threads).result() == 2
        assert torch.get_num_threads() == 2
    finally:
        set_threads(before)

"""The command's process settings: one malloc arena on glibc unless the user chose."""

from __future__ import annotations

import ctypes
import os

import pytest

from graphopt import cli


class _Libc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def libc(monkeypatch):
    fake = _Libc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    return fake


def test_one_arena_on_glibc(monkeypatch, libc):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    cli._one_malloc_arena()
    assert libc.calls == [(-8, 1)]


def test_the_users_setting_and_other_c_libraries_are_left_alone(monkeypatch, libc):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    cli._one_malloc_arena()
    monkeypatch.delenv("MALLOC_ARENA_MAX")

    def not_glibc(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "confstr", not_glibc)
    cli._one_malloc_arena()
    assert libc.calls == []

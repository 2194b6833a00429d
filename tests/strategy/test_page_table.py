"""A request's page table as a list and as an int32 array: the array always holds the list's entries, and reading
it converts only the entries given since the last read (what every step stages)."""

from __future__ import annotations

import pickle
import random

import numpy as np

from diffulex.strategy.page_table import PageTable, page_array


def test_the_array_follows_every_change_of_the_list():
    rng = random.Random(0)
    table, mirror = PageTable(), []
    for _ in range(2000):
        op = rng.choice(["append", "append", "extend", "pop", "pop_at", "clear", "set", "del", "insert", "sort"])
        if op == "append":
            page = rng.randrange(1 << 20)
            table.append(page)
            mirror.append(page)
        elif op == "extend":
            pages = [rng.randrange(1 << 20) for _ in range(rng.randrange(40))]
            table.extend(pages)
            mirror.extend(pages)
        elif op in ("pop", "pop_at", "del", "set") and mirror:
            i = rng.randrange(-len(mirror), len(mirror))
            if op == "pop":
                assert table.pop() == mirror.pop()
            elif op == "pop_at":
                assert table.pop(i) == mirror.pop(i)
            elif op == "del":
                del table[i]
                del mirror[i]
            else:
                table[i] = mirror[i] = rng.randrange(1 << 20)
        elif op == "clear" and rng.random() < 0.05:
            table.clear()
            mirror.clear()
        elif op == "insert":
            i, page = rng.randrange(len(mirror) + 1), rng.randrange(1 << 20)
            table.insert(i, page)
            mirror.insert(i, page)
        elif op == "sort":
            table.sort()
            mirror.sort()
        if rng.random() < 0.3:
            assert table.as_array().tolist() == mirror
    assert table == mirror and table.as_array().dtype == np.int32


def test_reading_the_array_converts_only_the_entries_appended_since_the_last_read():
    table = PageTable(range(1000))
    table.as_array()
    list.__setitem__(table, 0, -5)  # behind the table's back: an entry already converted is not read again
    table.append(1000)
    array = table.as_array()
    assert array[0] == 0 and array[-1] == 1000 and len(array) == 1001


def test_a_table_reads_as_the_plain_list_of_its_pages():
    table = PageTable([3, 1, 2])
    assert table == [3, 1, 2] and table[:2] == [3, 1] and list(reversed(table)) == [2, 1, 3]
    assert PageTable() == []


def test_a_pickled_table_keeps_its_pages_and_its_array_and_grows_on():
    table = pickle.loads(pickle.dumps(PageTable(range(40)), protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(table, PageTable) and table == [*range(40)] and table.as_array().tolist() == [*range(40)]
    table.append(40)
    table.pop(0)
    assert table.as_array().tolist() == [*range(1, 41)]
    assert pickle.loads(pickle.dumps(PageTable())) == []


def test_page_array_converts_a_plain_list_too():
    assert page_array([4, 5]).tolist() == [4, 5] and page_array([4, 5]).dtype == np.int32

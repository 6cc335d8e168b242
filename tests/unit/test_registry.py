import threading
import time

import pytest

from shared.bundle import BundleError
from shared.registry import Registry, UnknownName


def _reg() -> Registry:
    reg: Registry = Registry("colour")

    @reg.register("red", "rouge")
    class Red:
        pass

    reg.add("blue", "BLUE")
    return reg


def test_lookup_by_name_and_alias():
    reg = _reg()
    assert reg.get("red") is reg.get("rouge")
    assert reg.get("red").__name__ == "Red"  # the decorator returns its target unchanged
    assert reg.get("blue") == "BLUE"
    assert reg.names() == ["blue", "red"] and list(reg) == ["blue", "red"] and len(reg) == 2
    assert "rouge" in reg and "red" in reg and "green" not in reg


def test_unknown_name_lists_the_choices():
    reg = _reg()
    with pytest.raises(UnknownName) as e:
        reg.get("green")
    assert str(e.value) == "unknown colour 'green'; choose one of ['blue', 'red', 'rouge']"
    assert isinstance(e.value, ValueError)


def test_caller_resolved_names_are_listed_but_not_looked_up():
    reg: Registry = Registry("colour", also=("auto",))
    reg.add("red", 1)
    with pytest.raises(UnknownName, match=r"'auto'; choose one of \['auto', 'red'\]"):
        reg.get("auto")
    assert reg.choices() == ["auto", "red"] and reg.names() == ["red"]
    with pytest.raises(ValueError, match="registered already"):
        reg.add("auto", 2)


def test_own_error_class():
    reg: Registry = Registry("audio kind", error=BundleError)
    with pytest.raises(BundleError, match=r"unknown audio kind 'x'; choose one of \[\]"):
        reg.get("x")


@pytest.mark.parametrize("name, aliases", [("red", ()), ("green", ("rouge",)), ("green", ("red",)),
                                           ("rouge", ())])
def test_a_taken_name_is_refused(name, aliases):
    reg = _reg()
    with pytest.raises(ValueError, match="colour '(red|rouge)' is registered already"):
        reg.add(name, object(), *aliases)
    assert "green" not in reg  # nothing of a refused registration stays
    assert reg.get("red").__name__ == "Red"


def test_load_runs_once_before_the_first_lookup():
    calls = []
    reg: Registry = Registry("colour", load=lambda: calls.append(reg.add("red", 1)))
    assert calls == []
    assert reg.get("red") == 1 and "red" in reg and reg.names() == ["red"]
    assert calls == [1]


def test_load_runs_once_even_when_it_fails():
    calls = []

    def load():
        reg.add("red", 1)
        calls.append(1)
        raise ImportError("optional part missing")

    reg: Registry = Registry("colour", load=load)
    with pytest.raises(ImportError):
        reg.get("red")
    assert reg.get("red") == 1 and calls == [1]


def test_a_lookup_during_load_waits_for_it():
    started = threading.Event()

    def load():
        started.set()
        time.sleep(0.05)
        reg.add("red", 1)
        assert "red" in reg  # a registering module may look itself up

    reg: Registry = Registry("colour", load=load)
    t = threading.Thread(target=reg.names)
    t.start()
    started.wait()
    assert reg.get("red") == 1
    t.join()

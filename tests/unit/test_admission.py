"""The slot policy of every listening server (kvpool/sockets/admission.py): unproved connections never take a
proved one's slot, and a flood displaces its own oldest connections, not an honest newcomer."""

import pytest

from kvpool.sockets.admission import Admission


def test_a_flood_of_unproved_connections_never_takes_a_proved_slot():
    slots = Admission(limit=3, unproved=3, per_address=3)
    for name in ("a", "b"):
        assert slots.admit(name, "10.0.0.1") == (True, [])
        assert slots.prove(name)
    for i in range(50):  # strangers come and go; the proved two stay
        admitted, displaced = slots.admit(f"x{i}", "10.0.0.9")
        assert admitted and all(d.startswith("x") for d in displaced)
    assert slots.proved == {"a", "b"} and slots.unproved == 3
    assert slots.admit("c", "10.0.0.1")[0] and slots.prove("c")
    # Every proved slot taken: a new connection is turned away (it could not be served even proved).
    assert slots.admit("d", "10.0.0.1") == (False, [])


def test_a_new_connection_displaces_the_oldest_unproved_one():
    slots = Admission(limit=10, unproved=3, per_address=3)
    for name in ("f1", "f2", "f3"):
        slots.admit(name, "10.0.0.9")
    assert slots.admit("honest", "10.0.0.9") == (True, ["f1"])  # same address as the flood: still gets in
    assert slots.admit("f4", "10.0.0.9") == (True, ["f2"])
    assert slots.prove("honest") and not slots.prove("f1")  # a displaced connection cannot prove later
    assert slots.displaced == 2


def test_one_address_only_displaces_its_own_connections():
    slots = Admission(limit=10, unproved=4, per_address=2)
    slots.admit("other", "10.0.0.1")
    for i in range(20):
        admitted, displaced = slots.admit(f"f{i}", "10.0.0.9")
        assert admitted and "other" not in displaced
    assert slots.unproved == 3 and slots.prove("other")


def test_a_proved_connection_turned_away_when_the_slots_filled_meanwhile():
    slots = Admission(limit=1, unproved=4, per_address=4)
    slots.admit("early", "a")
    slots.admit("late", "b")
    assert slots.prove("late")
    assert not slots.prove("early") and slots.unproved == 0
    slots.forget("late")
    assert slots.admit("next", "a") == (True, []) and slots.prove("next")


def test_caps_below_one_are_refused():
    with pytest.raises(ValueError):
        Admission(limit=0)

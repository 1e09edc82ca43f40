"""The election's declared interface (LeadershipState): what the service, health and key feed read of it."""

import inspect

from kvpool.master.leadership.election import Election, LeadershipState


def declared_names() -> set[str]:
    methods = {name for name, member in vars(LeadershipState).items()
               if inspect.isfunction(member) and not name.startswith("_")}
    return set(LeadershipState.__annotations__) | methods


def test_election_provides_everything_leadership_state_declares():
    election = Election(None, "c", "m1", "127.0.0.1:1")  # no etcd call before start()
    assert declared_names() >= {"serving", "is_leader", "term", "leader_address", "holds_lease", "answering"}
    missing = sorted(name for name in declared_names() if not hasattr(election, name))
    assert missing == []


def test_a_new_election_neither_serves_nor_answers():
    election = Election(None, "c", "m1", "127.0.0.1:1")
    assert election.serving is False and election.is_leader is False
    assert election.answering() is False
    election.is_leader = True  # won, but neither taken over nor a lease refreshed: still no answers
    assert election.answering() is False

"""Where processes run and how they meet: an actor's device and Ray options (`devices`), placement
groups reserved or waited for (`groups`), and the loopback-safe stores process groups meet at
(`rendezvous`). The ground floor of engines/: it imports no other room.
"""

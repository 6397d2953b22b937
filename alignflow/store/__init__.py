"""Where a pipeline keeps what it makes: artifacts under one root URI (a directory or s3://), as actors see
them on any node (artifacts.py), what goes wrong with them (faults.py), and the content fingerprints of its
inputs for cache keys (fingerprint.py)."""

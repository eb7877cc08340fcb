//! Black-box test support: a real `vps` server on a fresh database, driven over HTTP.

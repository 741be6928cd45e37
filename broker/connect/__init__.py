"""Reaching Redis: the connection (`connection`, `sentinel`, `retry`), the password (`secrets`),
a private server (`redis_server`), the run's users (`acl`), key names (`keys`), Lua functions
(`functions`) and the client the broker's classes share (`redis_io`)."""

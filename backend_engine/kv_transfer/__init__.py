"""Prefill/decode disaggregation: moving a prompt's KV blocks from the replica that computed
them (role prefill) to the replica that decodes (role decode).

base.py      the interface (KVSender, KVReceiver and the events they report)
wire.py      the messages and the per-block checksum
block_io.py  blocks in and out of the paged KV tensors
tcp_*.py     the CPU implementation over TCP (pyzmq)
exports.py   prefill side: which computed blocks to hold and offer (engine thread)
imports.py   decode side: reservations, registration as cached blocks, claims (engine thread)
connector.py the engine's side, by role
params.py    what a request carries when it is one half of a P/D pair
"""

"""ddp_store: the rendezvous store of a DDPJob (the `<job>-rdzv` pod), without torch.

A small server, standard library only, that speaks torch's TCPStore wire protocol as torch's own client
(`torch.distributed.TCPStore(host, port, is_master=False)`, torch 2.13) speaks it, so that torchrun's agents, torch's
c10d rendezvous and the trainer's `ddpjob-c10d` backend use it as they would torch's own server. The pod then pulls a
few tens of MB instead of the multi-GB trainer image, and runs with requests and limits of its own (docs/contract.md,
"The rendezvous store").

- `protocol.py`: the wire format: query types, frame parsing, reply encoding, the limits;
- `state.py`: the keys, queues and waiting clients, and what each query does to them (no sockets);
- `server.py`: the event loop (one thread, `selectors`), connections, SIGTERM;
- `__main__.py`: `python -m ddp_store [--port N] [--host H]`.
"""

__version__ = "0.1.0"

"""Per-step cost of the tensor-parallel step channel on the host: rank 0 encoding one
step message and a worker decoding it back into a ScheduledBatch, for a decode batch.

    python bench/tp_channel.py [--rows 256]

No sockets and no GPU: the bytes go straight from the encoder to the decoder.
"""
import argparse
import random
import timeit

from tandem.distributed.channel import StepReceiver, StepSender
from tandem.distributed.wire import Admit, Step
from tandem.request import Request
from tandem.sampling import SamplingParams
from tandem.scheduler.batch import Row, ScheduledBatch


def decode_batch(n: int, params: SamplingParams) -> ScheduledBatch:
    """Rows like a steady decode step's: one new token each, sampled, nothing cached."""
    rng, rows = random.Random(0), []
    for slot in range(1, n + 1):
        req = Request("r", [], params, rng.getrandbits(63), max_samples=1000, slot=slot)
        start = rng.randint(100, 2000)
        rows.append(Row(req, start, [rng.randrange(1 << 20)], None, start - 100))
    return ScheduledBatch(1234, rows)


def best_us(fn) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(5, number)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=1000, temperature=0.7, top_p=0.9)
    batch = decode_batch(args.rows, params)
    sender = StepSender("127.0.0.1", b"k" * 32)  # its listener is never used here
    sent = []
    sender._send = lambda msg: sent.append(sender.encoder.encode(msg))
    receiver = StepReceiver(conn=None)  # the decoding half only
    for r in batch.rows:
        receiver.admit(Admit(r.req.slot, [], params, []))

    def encode() -> bytes:
        sent.clear()
        sender.launch(batch)
        return sent[0]

    data = encode()
    out = receiver.batch(receiver.decoder.decode(data))
    assert [(r.req.slot, r.req.seed, r.kv_slots, r.start) for r in out.rows] == \
        [(r.req.slot, r.req.seed, r.kv_slots, r.start) for r in batch.rows]
    enc, dec = best_us(encode), best_us(lambda: receiver.batch(receiver.decoder.decode(data)))
    wire = best_us(lambda: receiver.decoder.decode(data))
    print(f"{args.rows}-row decode step: {len(data)} bytes; encode {enc:.0f} us, decode {dec:.0f} us "
          f"(msgpack alone {wire:.0f} us), total {enc + dec:.0f} us")
    sender.close()


if __name__ == "__main__":
    main()

"""Speculative decoding: a proposer guesses a request's next tokens (ngram.py: prompt lookup;
draft.py: a small model's greedy continuation), controller.py decides how many of them pay for
themselves, one forward pass scores them, and sample/rejection.py keeps what the model agrees with. The
scheduler budgets and rolls back the proposals' KV slots (core/scheduler.py)."""

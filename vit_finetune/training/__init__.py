"""A run from a recipe to a finished folder: the plan with every `auto` resolved (plan), the run built (build, probe,
probe_checks), the loop and its step (loop, train_step, optim, ema, loss_scale, non_finite, interrupts), the weights
kept (selection, wise_ft), a teacher (distill), the devices (devices, sharding), the end (finish), and run.py, which
drives them in order.
"""

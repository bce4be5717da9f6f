"""What a run leaves behind and shows: the parts it trains with (parts), the events callbacks and trackers observe
(callbacks, tracking), checkpoints (checkpoint), the loop's log (train_log), the output folder it may write into
(output_guard), the final model, card and pictures (final_outputs, card), and the push (publish).
"""

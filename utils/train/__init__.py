"""Training: the engine (fit, train_one_epoch), run set-up, optimizer, EMA, loss, checkpoints, results.csv."""

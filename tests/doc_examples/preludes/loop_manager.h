// Prelude "loop_manager": the prelude "loop" (a MirroredStrategy training
// loop's parts: `strategy`, `opt`, `dist`, `epochs`, `epoch`, `step`,
// train_step(batch)) and a CheckpointManager `manager` (directory ckpt) of
// a Checkpoint of the variables and `opt`.
// @extends: loop
// @body
ds::Checkpoint checkpoint(strategy, {&opt});
ds::CheckpointManager manager(checkpoint, "ckpt", {/*max_to_keep=*/2});

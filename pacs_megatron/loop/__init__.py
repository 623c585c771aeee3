"""The training loop and its named stages, one folder in data-flow order (train.py reads top to bottom):

    train            the one-page loop: a step's rollouts, update, weights out, validation, checkpoint
    sources          where a step's rollouts come from: the colocated engine or the pipeline of engines
    async_stages     what the pipeline adds: take a step's rollouts, push the weights as a policy version
    sampling_stages  dynamic sampling (group filtering rounds) and the overlong penalty
    critic_stages    the learned critic (GAE advantages, its update); no-ops without one
    update_stages    this rank's rows, pi_old's log-probs, the actor's update, the reference reset
    advantages       outcome advantages, or the run's own advantage function (the critic's GAE)
    stages           sampling, scoring and the step's batch; validation
    warmup           the supervised format warm-up before RL
    diagnostics      the PACS metrics recomputed after the update (``pacs/post_*``)
    runtime          what a run holds besides the loop: process groups, directories, resume, the components
    build            the components (actor, critic, engine, prompts) from the run config's sections

Only this folder (and launch/, which starts it) runs a step; everything below it is a library that takes the
config sections it reads (the run config stops here: pyproject.toml's contract).
"""

"""The plan stage: between the job's config (what the user wrote) and the objects that run it.

    specs.py       RolloutSpec, EngineSpec, LearnerSpec, JobPlan and the config-only resolutions
    job.py         plan_job: one rank's plan on its device (memory, micro-batch, the engines' specs)
    memory.py      the memory plan of a job (analysis.memory_plan applied to a TrainConfig)
    preflight.py   checks that a job can run on this machine, before anything is built
"""

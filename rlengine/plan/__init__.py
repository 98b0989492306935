"""The plan stage: between the job's config (what the user wrote) and the objects that run it.

    preflight.py   checks that a job can run on this machine, before anything is built
"""

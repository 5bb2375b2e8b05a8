"""Analysis under the transformers a repository was written for.

Hub custom code written for transformers 4.x often does not build under the installed
transformers 5 (imports that are gone, config defaults that changed). Its analysis then
runs in a child process whose ``sys.path`` starts with an overlay holding that release
(``environment.py``, installed on demand into the user's cache); the child resolves the
repository with its own code, analyses it and builds the validation checkpoints and their
references (``front.py``); this process emits the file and runs it in the installed vLLM
(``client.py``).
"""

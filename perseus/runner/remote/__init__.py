"""Jobs whose machines an engine owns (Ray, Spark): MPI started through the engine's own workers.

Ray and Spark place worker processes (actors, tasks) on their nodes; perseus does not log in to those nodes
with ssh. Instead, every worker runs a :class:`~perseus.runner.remote.service.NodeService`, and ``mpirun``
is told (Open MPI 5: PRRTE's ``plm_ssh_agent``) to start its daemon on a node with
``python -m perseus.runner.remote.agent NODE COMMAND`` instead of ``ssh NODE COMMAND``. The agent asks the
node's service to run the command, relays its input, output and exit status, and ends it when the agent's
connection drops, as ssh does. The MPI job that forms is an ordinary ``mpirun`` job: every engine feature,
elastic re-forms and checkpoint keepers work as under perseusrun (whose elastic driver also starts keepers
and kills strays through the agent here).

Each node gets a name of its own (``perseus-node-<i>``) in ``mpirun``'s host list, so that ``mpirun`` starts
a daemon through the agent on every node, the one it runs on included: the ranks are then children of the
engine's workers, inside their resource limits, and die with them.

Modules: :mod:`~perseus.runner.remote.service` (the worker's side), :mod:`~perseus.runner.remote.agent` (the
ssh stand-in), :mod:`~perseus.runner.remote.job` (the ``mpirun`` command), :mod:`~perseus.runner.remote.rank`
(a long-lived rank that runs functions sent to it: Ray's executors).
"""

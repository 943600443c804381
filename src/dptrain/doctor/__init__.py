"""`dptrain doctor`: before a multi-node run hangs, name what would break it and how to fix it.

    facts.py    what one node says about itself: names, addresses, interface, versions, files, disk, /dev/shm, devices
    checks.py   the verdicts: the facts and measurements -> one line per check, ok / warn / fail, and what to do
    rank.py     each rank of the doctor: the facts exchanged through the run's store, the checks only the nodes
                together can make, a short matmul and a ping-pong per pair of nodes; rank 0 writes doctor.json
    command.py  the command on each node: its facts, the ranks started as training starts them, node 0's table
"""

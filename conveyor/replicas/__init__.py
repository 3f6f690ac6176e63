"""conveyor engines as Ray Serve replicas (`conveyor serve --replicas N`); needs `pip install conveyor[ray]`.

routing.py and prompt_prefix.py decide where a request goes, router.py plugs that into Ray Serve,
http_bridge.py carries HTTP between the ingress and a replica's app, metrics_merge.py joins the
replicas' /metrics, config.py holds ReplicaConfig, deployments.py declares the Serve application and launch.py runs it.
"""

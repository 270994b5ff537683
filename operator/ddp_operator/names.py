"""Every string that crosses a boundary: API names, labels, annotations, env vars, reasons, ports.

Other modules import these constants; nothing else in the package spells them out.
"""

# --- API ------------------------------------------------------------------------------------------
GROUP = "ddp.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DDPJob"
PLURAL = "ddpjobs"
SINGULAR = "ddpjob"
SHORT_NAMES = ("ddpj",)
CATEGORIES = ("all", "ddp")
CRD_NAME = f"{PLURAL}.{GROUP}"

# --- Children -------------------------------------------------------------------------------------
TRAINER_CONTAINER = "trainer"
# restartPolicy of the training pods: the kubelet restarts a failed trainer container in the same pod.
TRAINER_RESTART_POLICY = "OnFailure"
RDZV_CONTAINER = "rdzv-store"
RDZV_POD_SUFFIX = "rdzv"
# The job's metric history (ddp_operator.history), read by `kubectl ddp plot`.
HISTORY_CONFIGMAP_SUFFIX = "history"
SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
CHECKPOINT_VOLUME = "checkpoint"
# Jobs on ddpjob-c10d (spares, elastic): spec.nodes in a pod annotation, which the kubelet writes into a file of a downward API volume;
# the rendezvous backend (ddpjob-c10d) follows it, so `kubectl scale` re-forms the group at the new size.
NODES_ANNOTATION = f"{GROUP}/nodes"
NODES_VOLUME = "ddpjob-nodes"
NODES_DIR = "/etc/ddpjob"
NODES_FILE = "nodes"
# Volume names the operator adds to training pods; a template may not use them (spec.checkpoint / spec.shm).
OPERATOR_VOLUMES = (SHM_VOLUME, CHECKPOINT_VOLUME, NODES_VOLUME)
TERMINATION_LOG = "/dev/termination-log"
NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"

# Longest job name that keeps `<job>-rdzv` and `<job>-<index>` (index < MAX_NODES) within 63 characters.
MAX_NODES = 1000
# Most hot spares a job may keep (spec.spares); nodes + spares pods must still fit below MAX_NODES.
MAX_SPARES = 100
MAX_NAME_LENGTH = 63 - len("-" + RDZV_POD_SUFFIX)

# --- Labels and annotations -----------------------------------------------------------------------
LABEL_JOB_NAME = f"{GROUP}/job-name"
LABEL_NODE_INDEX = f"{GROUP}/node-index"
LABEL_ROLE = f"{GROUP}/role"
LABEL_GROUP = f"{GROUP}/group"
# A short hash of what shapes a pod (pod_hash.py): pods of one shape share it; the operator never acts on it.
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"
ROLE_TRAINER = "trainer"
ROLE_RDZV = "rdzv"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# Set by the API server on every namespace: how a NetworkPolicy selects one namespace by name.
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
MANAGED_BY = "ddp-operator"
# The container `kubectl logs <pod>` shows: the trainer, though the pod also runs the diagnostics sidecar.
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
# On spec.template.metadata: "false" turns off the default spread of the trainer pods over nodes (placement.py).
SPREAD_ANNOTATION = f"{GROUP}/spread-across-nodes"

# --- Timing ---------------------------------------------------------------------------------------
# torchrun exits 0 only when every worker finished, so a trainer still running this long after a peer
# exited 0 is an agent waiting for a rendezvous that will never complete; it is stopped.
SUCCESS_GRACE_SECONDS = 60
# The grace period of a hung pod's deletion: its stuck process cannot act on SIGTERM anyway (1, not 0: 0 is a
# force deletion, which frees the name before the kubelet has stopped the old containers).
HANG_DELETE_GRACE_SECONDS = 1

# --- Ports ----------------------------------------------------------------------------------------
DEFAULT_RDZV_PORT = 29400
PROGRESS_PORT = 29401
# The diagnostics sidecar (docs/diagnostics.md): a container beside the trainer, in the pod's process namespace,
# that reads every torchrun worker's rank, CPU time and Python stack (py-spy) and serves them as JSON on
# DIAGNOSTICS_PORT at DIAGNOSTICS_PATH. Its init container copies py-spy and the server (a stdlib-only script run by
# the trainer image's python3, as the trainer's user) from the diagnostics image into DIAGNOSTICS_VOLUME.
DIAGNOSTICS_CONTAINER = "ddp-diagnostics"
DIAGNOSTICS_TOOLS_CONTAINER = "ddp-diagnostics-tools"
DIAGNOSTICS_VOLUME = "ddp-diagnostics"
DIAGNOSTICS_DIR = "/opt/ddp-diagnostics"
DIAGNOSTICS_PORT = 29402
DIAGNOSTICS_PATH = "/diagnosis"
# The operator's environment: the image the init container copies the tools from (the chart sets its own image).
ENV_DIAGNOSTICS_IMAGE = "DDPJOB_DIAGNOSTICS_IMAGE"
PROGRESS_PATH = "/progress"
DEFAULT_METRICS_PORT = 8080
DEFAULT_LIVENESS_PORT = 8081
LIVENESS_PATH = "/healthz"
# The operator's readiness (probes.py): 200 only in the replica that acts, so its Service reaches the leader alone.
DEFAULT_READINESS_PORT = 8082
READINESS_PATH = "/readyz"
# The operator's environment: the pull policy of the diagnostics tools image (ENV_DIAGNOSTICS_IMAGE); unset: the
# kubelet's default.
ENV_DIAGNOSTICS_IMAGE_PULL_POLICY = "DDPJOB_DIAGNOSTICS_IMAGE_PULL_POLICY"
# The operator's environment: the rendezvous store's image of every job that names none (rdzv_spec.py; the chart sets
# it from storeImage).
ENV_STORE_IMAGE = "DDP_OPERATOR_STORE_IMAGE"

# --- Trainer environment (docs/contract.md) -------------------------------------------------------
ENV_NNODES = "PET_NNODES"
ENV_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
ENV_RDZV_BACKEND = "PET_RDZV_BACKEND"
ENV_RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
ENV_RDZV_ID = "PET_RDZV_ID"
ENV_RDZV_CONF = "PET_RDZV_CONF"
ENV_LOCAL_ADDR = "PET_LOCAL_ADDR"
ENV_MAX_RESTARTS = "PET_MAX_RESTARTS"
ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"
ENV_PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
ENV_JOB_NAME = "DDPJOB_NAME"
ENV_JOB_NAMESPACE = "DDPJOB_NAMESPACE"
ENV_POD_INDEX = "DDPJOB_POD_INDEX"
# The wanted number of training nodes, a file the kubelet keeps (NODES_ANNOTATION); jobs on ddpjob-c10d only.
ENV_NODES_FILE = "DDPJOB_NODES_FILE"
ENV_CHECKPOINT_DIR = "DDPJOB_CHECKPOINT_DIR"
ENV_SNAPSHOT_DIR = "DDPJOB_SNAPSHOT_DIR"
ENV_PROGRESS_PORT = "DDPJOB_PROGRESS_PORT"
ENV_RDZV_PORT = "DDPJOB_RDZV_PORT"
RDZV_BACKEND = "c10d"
# Jobs with spec.spares or minNodes < maxNodes (spec.torchrun.rdzvBackend auto): torch's c10d with the rules that keep
# spares from livelocking the group and close a round at the desired size (the trainer image's ddp_trainer.rendezvous, registered through the torchrun.handlers entry point).
RDZV_BACKEND_SPARES = "ddpjob-c10d"
# The last log line of a spare's torchrun released because a participant closed the rendezvous (the training
# ended): with FallbackToLogsOnError it ends the termination message. Such an exit is not a failure.
SPARE_RELEASED_MARKER = f"{RDZV_BACKEND_SPARES}: spare released"
SNAPSHOT_DIR = "/dev/shm/ddpjob"
# torchrun options the operator owns, in torchrun's `-` spelling. torchrun accepts `-` and `_` alike and reads
# each from PET_<OPTION>, so `torchrun.extraArgs` is checked after normalising `_` to `-`, and the trainer
# container's env may not set any of RESERVED_ENV. Every option starting with RESERVED_OPTION_PREFIX is owned too.
RESERVED_TORCHRUN_OPTIONS = (
    "nnodes", "nproc-per-node", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "local-addr",
    "max-restarts", "node-rank", "master-addr", "master-port", "standalone",
)
RESERVED_OPTION_PREFIX = "rdzv-"
ENV_PREFIX = "PET_"
RESERVED_ENV = tuple(ENV_PREFIX + o.replace("-", "_").upper() for o in RESERVED_TORCHRUN_OPTIONS)
RESERVED_ENV_PREFIX = ENV_PREFIX + RESERVED_OPTION_PREFIX.replace("-", "_").upper()
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
# spec.torchrun.rdzvBackend: "auto" picks RDZV_BACKEND_SPARES for jobs with spares or an elastic range (a round
# closes at spec.nodes, env.rdzv_backend), else RDZV_BACKEND; both may also be named.
RDZV_BACKEND_AUTO = "auto"
RDZV_BACKENDS = (RDZV_BACKEND_AUTO, RDZV_BACKEND, RDZV_BACKEND_SPARES)
# torch's registry when torchrun is asked for a backend nobody registered (torch 2.13, rendezvous/api.py): the last
# line of the log, so of the termination message, of a trainer image without ddp_trainer run with ddpjob-c10d.
RDZV_BACKEND_MISSING_TEXT = f"ValueError: The rendezvous backend '{RDZV_BACKEND_SPARES}' is not registered"
# ddp_trainer's refusal of a torch outside the range its launcher and ddpjob-c10d backend are tested with
# (ddp_trainer.torch_version, exit code 78): the last line of the log of a trainer that refused to start.
TORCH_UNSUPPORTED_TEXT = "ddp_trainer: unsupported torch"

# --- Status ---------------------------------------------------------------------------------------
PHASE_PENDING = "Pending"
PHASE_RUNNING = "Running"
PHASE_RESTARTING = "Restarting"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
PHASE_SUSPENDED = "Suspended"
PHASES = (PHASE_PENDING, PHASE_RUNNING, PHASE_RESTARTING, PHASE_SUCCEEDED, PHASE_FAILED, PHASE_SUSPENDED)
FINISHED_PHASES = (PHASE_SUCCEEDED, PHASE_FAILED)

COND_CREATED = "Created"
COND_RUNNING = "Running"
COND_RESTARTING = "Restarting"
COND_SUSPENDED = "Suspended"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
# True while a child (Pod, Service) cannot be created: an object the job does not own holds its name.
# Also True while the API server refuses to create a child (reason FailedCreate: quota, PodSecurity, a webhook).
COND_REPLICA_FAILURE = "ReplicaFailure"
# True while a pod of the job exists but the kubelet cannot start it: the kubelet's reason (ErrImagePull,
# ImagePullBackOff, CreateContainerConfigError, ...) and message.
COND_PODS_NOT_STARTING = "PodsNotStarting"
# True while the job stalls without failing (docs/diagnostics.md; reasons below, by REASON_PG_NEVER_FORMED).
COND_STALLED = "Stalled"
CONDITION_TYPES = (COND_CREATED, COND_RUNNING, COND_RESTARTING, COND_SUSPENDED, COND_SUCCEEDED, COND_FAILED,
                   COND_REPLICA_FAILURE, COND_PODS_NOT_STARTING, COND_STALLED)

# Condition reasons double as Event reasons.
REASON_CREATED = "JobCreated"
REASON_RUNNING = "AllNodesRunning"
REASON_WAITING = "WaitingForNodes"
REASON_NODE_FAILED = "NodeFailed"
REASON_NODE_DISRUPTED = "NodeDisrupted"
REASON_NODE_MISSING = "NodeMissing"
REASON_RDZV_LOST = "RendezvousStoreLost"
# A trainer found its rendezvous closed (plain torchrun closes it when an agent gives up); the store is made anew.
REASON_RDZV_CLOSED = "RendezvousClosed"
REASON_RDZV_RESET = "RendezvousReset"
REASON_HANG = "Hang"
# status.lastRecovery.fault when the trainer recovered without an incident the operator saw
FAULT_WORKER_RESTART = "WorkerRestart"
FAULT_UNKNOWN = "Unknown"
# status.lastRecovery.resumedFrom (the trainer's progress `recovery.resumedFrom`)
RESUMED_FROM = ("peer", "local", "disk", "start")
REASON_RESTARTED_IN_PLACE = "TrainerRestarted"
REASON_SUSPENDED = "JobSuspended"
REASON_RESUMED = "JobResumed"
REASON_SUCCEEDED = "TrainingSucceeded"
REASON_BACKOFF_LIMIT = "BackoffLimitExceeded"
REASON_INFRA_BACKOFF_LIMIT = "InfraBackoffLimitExceeded"
# A replacement pod kept off nodes that failed the job twice (plan/avoid.py): its Event.
REASON_NODE_AVOIDED = "NodeAvoided"
REASON_PERMANENT_EXIT = "PermanentExitCode"
REASON_DEADLINE = "DeadlineExceeded"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_FORCE_DELETED = "StuckPodForceDeleted"
REASON_SCALED = "Scaled"
REASON_PHASE_CHANGED = "PhaseChanged"
REASON_TTL_EXPIRED = "TTLExpired"
REASON_CREATE_FAILED = "FailedCreate"
REASON_CHILD_CONFLICT = "ChildConflict"
REASON_CHILDREN_CREATED = "ChildrenCreated"
REASON_PODS_STARTED = "PodsStarted"
REASON_STARTUP_TIMEOUT = "StartupTimeoutExceeded"
# A pod on a node NotReady for longer than failurePolicy.nodeLostTimeoutSeconds: a disruption (attempt reason,
# and the Event of its force-deletion).
REASON_NODE_LOST = "NodeLost"
REASON_SPARE_RELEASED = "SpareReleased"
# A trainer report (termination message, progress endpoint) with fields of the wrong type or out of range: they
# are dropped, the rest used (status.valid_report).
REASON_INVALID_REPORT = "InvalidReport"
# A trainer image without ddp_trainer run with ddpjob-c10d (RDZV_BACKEND_MISSING_TEXT): the job fails at once.
REASON_RDZV_BACKEND_MISSING = "RendezvousBackendMissing"
# A trainer that refused its image's torch (TORCH_UNSUPPORTED_TEXT): a configuration error, the job fails at once.
REASON_TORCH_UNSUPPORTED = "UnsupportedTorch"
# A stall (docs/diagnostics.md): condition Stalled is True while the job's process group has not formed past
# failurePolicy.processGroupTimeoutSeconds (reason ProcessGroupNeverFormed: the attempt's reason too, and the
# failure's after a second identical diagnosis) or while a script that reports no progress is hung (reason Hang).
REASON_PG_NEVER_FORMED = "ProcessGroupNeverFormed"
REASON_PG_FORMED = "ProcessGroupFormed"  # Stalled=False once every rank joined

# Why a pod that exists cannot start. Container waiting reasons set by the kubelet (CrashLoopBackOff is not
# one: that container did start), and the scheduler's PodScheduled=False reason.
# The image ones are an infrastructure failure (status.lastFailure: Infrastructure, ImagePull; failure_class.py).
IMAGE_REASONS = (
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable",
    "SignatureValidationFailed",
)
STARTUP_WAITING_REASONS = (
    *IMAGE_REASONS, "CreateContainerConfigError", "CreateContainerError", "PreCreateHookError", "PreStartHookError",
)
# The kubelet alternates these while it retries a pull: one condition reason (the first seen) for all of them.
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff")
REASON_UNSCHEDULABLE = "Unschedulable"

# Pod condition / status reasons that mark a disruption (not the training's fault).
DISRUPTION_CONDITION = "DisruptionTarget"
DISRUPTION_REASONS = (
    "Evicted", "Preempting", "PreemptionByScheduler", "DeletionByTaintManager", "EvictionByEvictionAPI",
    "DeletionByPodGC", "TerminationByKubelet", "NodeLost", "NodeShutdown", "Shutdown", "Terminated",
    "UnexpectedAdmissionError", "OutOfcpu", "OutOfmemory",
)

ATTEMPTS_HISTORY = 20
# status.recordedPods holds the UIDs of ended pods that still exist: at most two groups' pods at once
# (the old group being deleted while the new one starts), each up to MAX_NODES trainers and a store.
MAX_RECORDED_PODS = 2 * (MAX_NODES + 1)

# --- Kueue (kueue.py): the DDPJob as one Kueue Workload ---------------------------------------------
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOAD_KIND = "Workload"
WORKLOAD_PLURAL = "workloads"
RESOURCE_FLAVOR_PLURAL = "resourceflavors"
WORKLOAD_PRIORITY_CLASS_KIND = "WorkloadPriorityClass"
WORKLOAD_PRIORITY_CLASS_PLURAL = "workloadpriorityclasses"
# The labels a user puts on the DDPJob, as on any Kueue-managed job.
LABEL_QUEUE_NAME = f"{KUEUE_GROUP}/queue-name"
LABEL_PRIORITY_CLASS = f"{KUEUE_GROUP}/priority-class"
# On a Workload the operator deactivated because the job was suspended (only that is undone on resume).
WORKLOAD_SUSPENDED_ANNOTATION = f"{GROUP}/suspended"
# Kueue's own label on a workload: the UID of the job it stands for.
LABEL_KUEUE_JOB_UID = f"{KUEUE_GROUP}/job-uid"
# The workload's pod sets: the trainer pods (nodes + spares) and the rendezvous store pod.
POD_SET_TRAINER = "trainer"
POD_SET_RDZV = "rdzv"
# Workload condition types and reasons (Kueue's API).
WL_QUOTA_RESERVED = "QuotaReserved"
WL_ADMITTED = "Admitted"
WL_EVICTED = "Evicted"
WL_FINISHED = "Finished"
WL_REQUEUED = "Requeued"
WL_REASON_PENDING = "Pending"
WL_REASON_NO_RESERVATION = "NoReservation"
WL_REASON_SUCCEEDED = "Succeeded"
WL_REASON_FAILED = "Failed"
# Evictions after which Kueue expects the Requeued condition True (its job framework does the same).
WL_REQUEUED_EVICTIONS = ("Preempted", "NodeFailures")
# DDPJob condition Suspended reasons while Kueue holds the job.
REASON_QUEUED = "Queued"
REASON_ADMITTED = "Admitted"
REASON_EVICTED = "Evicted"
REASON_QUEUE_DISABLED = "KueueIntegrationDisabled"
# Warning Event: the queue label of a job that still has a Workload was removed (kueue.kept_queue).
REASON_QUEUE_LABEL_REMOVED = "QueueLabelRemoved"


def history_configmap(job: str) -> str:
    """The name of a job's metric-history ConfigMap."""
    return f"{job}-{HISTORY_CONFIGMAP_SUFFIX}"

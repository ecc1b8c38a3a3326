/**
 * The server extension's REST contract (docs/server-api.md) as types, and the
 * two GET requests the extension makes. Everything goes through
 * ServerConnection so the base URL, token and XSRF cookie are handled the same
 * way JupyterLab handles them for its own services.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The jupyter_events schema id of the server's kernel events. */
export const EVENT_SCHEMA_ID =
  'https://jupyter-gpufrac.github.io/events/kernel/v1';

/** States the server reports for a kernel (its `state` field). */
export type KernelState =
  | 'guaranteed'
  | 'bursting'
  | 'move-pending'
  | 'migrating'
  | 'shrinking'
  | 'oom-killed'
  | 'restored'
  | 'restore-incomplete'
  | 'agent-unreachable'
  | 'no-gpu'
  | 'parked'
  | 'waiting-for-gpu';

/** Event names of the kernel event schema. */
export type EventName =
  | 'placed'
  | 'bursting'
  | 'shrink_requested'
  | 'move_pending'
  | 'migrating'
  | 'migrated'
  | 'oom_killed'
  | 'restored'
  | 'no_gpu'
  | 'agent_unreachable'
  | 'agent_reachable'
  | 'parked'
  | 'unparked'
  | 'frozen'
  | 'resumable';

/**
 * What keeps a kernel's state while it has no GPU, in the server's words:
 * its process frozen by the driver (every variable, open file and thread
 * kept), or the last good checkpoint on disk (a restart restores from it).
 */
export const FROZEN_IN_HOST_MEMORY = 'frozen in host memory';
export const CHECKPOINT_ON_DISK = 'checkpoint on disk';
export type Protection =
  typeof FROZEN_IN_HOST_MEMORY | typeof CHECKPOINT_ON_DISK;

export interface IGpuRef {
  uuid: string;
  index: number;
  name: string;
  simulated?: boolean;
  memory_total?: number;
}

/** A lease as the agent describes it (docs/agent-api.md); only what we show. */
export interface ILease {
  id: string;
  kind: 'notebook' | 'job' | string;
  kernel_id?: string | null;
  name?: string;
  request: number;
  limit: number;
  request_spec?: string;
  limit_spec?: string;
  devices?: number;
  logical_gpu?: string | null;
  physical_gpu?: string | null;
  target_gpus?: string[];
  usage?: number;
  bursting?: boolean;
  /** Share of the GPU's compute (0-1), held only where CUDA MPS runs. */
  compute_request?: number | null;
  compute_limit?: number | null;
  /** SM utilization of the lease's processes, percent; null where not sampled. */
  compute_usage?: number | null;
  state: string;
  reason?: string;
  /** Whether the driver holds its processes' GPU state in their host memory. */
  frozen?: boolean;
  /** Unix seconds since when it is frozen; null while not frozen. */
  frozen_at?: number | null;
  /** GPU memory the freeze moved into host memory, bytes (0 while not frozen). */
  frozen_bytes?: number;
  /** UUIDs of the GPUs it was frozen on. */
  frozen_gpus?: string[];
  /** What keeps its state while it has no GPU. */
  protection?: Protection | string;
  /** Why freezing could not be used the last time it was tried; '' when it could. */
  fallback?: string;
  created?: number;
  updated?: number;
  /** For a kernel of this server: its account as of this very lease. */
  account?: IKernelAccount;
}

/** One kernel event, as it arrives on the event stream or in `events`. */
export interface IGpuFracEvent {
  kernel_id: string;
  event: EventName | string;
  message?: string;
  reason?: string;
  gpu_index?: number | null;
  gpu_uuid?: string | null;
  from_gpu_index?: number | null;
  to_gpu_index?: number | null;
  request?: number;
  limit?: number;
  usage?: number;
  restored?: string[];
  lost?: string[];
  /** For `restored`: variables kept on disk (name to bytes); `%gpu restore` loads them. */
  deferred?: Record<string, number>;
  /** For `restored`: true only when nothing was lost and no cell was cut off. */
  ok?: boolean;
  /** For `restored`: why it restored ("resumed": its notebook's earlier kernel's state). */
  cause?: string;
  /** For `restored`: the cell the move or kill cut off, "[7] first line". */
  interrupted_cell?: string;
  /** For `move_pending`: unix seconds at which the running cell is cut off. */
  deadline?: number;
  seconds?: number;
  /** For `parked` and `frozen`: what keeps the kernel's state while it has no GPU. */
  protection?: Protection | string;
  /** For `parked` and `frozen`: GPU memory the freeze moved into host memory, bytes. */
  frozen_bytes?: number;
  /** The notebook's path, when the server knows it. */
  notebook?: string;
  time?: number;
}

/** The kernel's last restore, as the kernel reported it (docs/server-api.md). */
export interface IRestore {
  ok: boolean;
  restored: string[];
  lost: string[];
  lost_reasons?: Record<string, string>;
  deferred?: Record<string, number>;
  interrupted_cell?: string | null;
  checkpoint_cell?: number | null;
  error?: string | null;
  message: string;
  time?: number;
}

/**
 * Where a kernel's request and limit came from, in the server's words:
 * "kernelspec", "c.GpuFrac", "%gpu request", "RUNAI_GPU_MEMORY_LIMIT", … (the
 * list may grow; shown as given). `limit` is null when none was set.
 */
export interface IShareSource {
  request: string;
  limit?: string | null;
}

/**
 * What a restart restores now, from the last durable checkpoint's header
 * (docs/server-api.md): its cell and unix time, and the variables the disk
 * budget left out (name -> bytes) with why.
 */
export interface IRecoveryPoint {
  durable_cell: number | null;
  durable_time: number | null;
  unprotected: Record<string, number>;
  unprotected_why?: string | null;
  /**
   * The checkpoint being written (null: none); absent when the kernel did
   * not answer. `queued`: waiting for the one before it.
   */
  writing?: {
    cell: number | null;
    bytes_done: number;
    bytes_total: number;
    queued?: boolean;
  } | null;
  /** Why the last write failed (the recovery point above stays), or null. */
  error?: string | null;
}

/** A kernel's newest event, in short (the account's `last_event`). */
export interface ILastEvent {
  event: EventName | string;
  message: string;
  time: number;
}

/**
 * The server's one account of a kernel: what every view says of it. The
 * kernel status has these fields at its top; the node's leases of this
 * server's kernels carry them as `account`.
 */
export interface IKernelAccount {
  state: KernelState | string;
  reason?: string | null;
  /** move-pending: unix seconds at which the running cell is cut off. */
  deadline?: number | null;
  gpu: IGpuRef | null;
  request?: number | null;
  limit?: number | null;
  usage?: number | null;
  /** Absent from older servers, null for a lease older than the server process. */
  share_source?: IShareSource | null;
  /** Absent from older servers; null before the first event. */
  last_event?: ILastEvent | null;
  /** While frozen: the GPU it was frozen on (and waits for); null otherwise. */
  frozen_on?: IGpuRef | null;
}

/** `GET /api/gpufrac/kernels/<id>` */
export interface IKernelStatus extends IKernelAccount {
  kernel_id: string;
  lease?: ILease | null;
  events?: IGpuFracEvent[];
  notebook?: string | null;
  restore?: IRestore | null;
  /**
   * What keeps its state while it has no GPU: "frozen in host memory" while
   * frozen, else "checkpoint on disk"; null without a lease, absent from
   * older servers.
   */
  protection?: Protection | string | null;
  /** Why freezing could not be used the last time it was tried, or null. */
  fallback?: string | null;
  /** Null before the first checkpoint; absent from older servers. */
  checkpoint?: IRecoveryPoint | null;
  /**
   * The state an earlier kernel of its notebook left, waiting for the user's
   * word (c.GpuFrac.resume "ask"); null when none waits.
   */
  resumable?: IResumable | null;
}

/** What an earlier kernel of the notebook left (`resumable` of the kernel view). */
export interface IResumable {
  cell: number | null;
  time: number | null;
  variables: number;
  /** How the earlier kernel ended, in the server's words. */
  ended: string;
  /** The question as the `resumable` event put it, once put. */
  message: string | null;
}

export interface INodeGpu extends IGpuRef {
  memory_total: number;
  memory_used: number;
  memory_free: number;
  utilization?: number | null;
  healthy: boolean;
  leases?: string[];
}

/** `GET /api/gpufrac/node` */
export interface INodeInfo {
  simulated: boolean;
  backend: string | null;
  /** Whether CUDA MPS runs on the node: only then are compute shares held. */
  mps?: boolean;
  /**
   * Whether the node freezes kernels, and why not; null when the agent did
   * not say (absent from older servers).
   */
  freezing?: { available: boolean; why: string | null } | null;
  agent?: {
    socket?: string;
    embedded?: boolean;
    available?: boolean;
    error?: string | null;
  };
  gpus: INodeGpu[];
  leases: ILease[];
  /**
   * What is wrong with the server's c.GpuFrac settings, one sentence each;
   * kernels start without a lease until fixed. Absent from older servers.
   */
  config_problems?: string[];
}

/** A failed request; `status` 0 means the server could not be reached. */
export class ApiError extends Error {
  /**
   * @param fromExtension - the answer was the extension's JSON error; a 404
   *   without it means the server extension itself is not there.
   */
  constructor(
    readonly status: number,
    message: string,
    readonly fromExtension = false
  ) {
    super(message);
  }
}

async function getJSON<T>(
  path: string,
  settings: ServerConnection.ISettings
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, 'api', 'gpufrac', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, {}, settings);
  } catch (err) {
    throw new ApiError(0, String(err));
  }
  let body: any = null;
  try {
    body = await response.json();
  } catch {
    // A proxy error page or an empty body: report the status alone.
  }
  if (!response.ok) {
    const detail = body?.error?.message ?? body?.error ?? body?.message;
    throw new ApiError(
      response.status,
      typeof detail === 'string' ? detail : response.statusText,
      typeof detail === 'string'
    );
  }
  return body as T;
}

export function fetchKernelStatus(
  kernelId: string,
  settings: ServerConnection.ISettings
): Promise<IKernelStatus> {
  return getJSON<IKernelStatus>(
    URLExt.join('kernels', encodeURIComponent(kernelId)),
    settings
  );
}

export function fetchNode(
  settings: ServerConnection.ISettings
): Promise<INodeInfo> {
  return getJSON<INodeInfo>('node', settings);
}

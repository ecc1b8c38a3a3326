/**
 * What the extension knows about the current kernel's GPU lease, and about the
 * node (its GPUs and whether the GPU agent answers).
 *
 * Sources, first come first shown: the server's jupyter_events stream
 * (immediate, the primary source), a Poll of GET /api/gpufrac/kernels/<id>
 * (the fallback: it catches events lost while the websocket was reconnecting
 * and gives the authoritative figures after every event) and a Poll of GET
 * /api/gpufrac/node (the agent's health, the GPUs for the panel). Both polls
 * run every 5 s while the page is visible, every second while a move or a kill
 * is under way, and stand by while the page is hidden or nothing is followed.
 *
 * The agent's health is one fact for the whole node: whichever says so first
 * (an `agent_unreachable` event of any kernel, a kernel state
 * `agent-unreachable`, the node's `agent.available === false`) makes every
 * lease state read "agent unreachable" until a newer signal says it answers.
 */
import { Event, ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  ApiError,
  CHECKPOINT_ON_DISK,
  EVENT_SCHEMA_ID,
  FROZEN_IN_HOST_MEMORY,
  fetchKernelStatus,
  fetchNode,
  IGpuFracEvent,
  IKernelStatus,
  INodeInfo
} from './api';
import {
  AGENT_SILENT_STATES,
  EVENT_STATE,
  KERNEL_STATES,
  RESTORE_INCOMPLETE
} from './contract';
import { eventKey } from './format';
import { MIN_REFRESH_MS } from './settings';
import { IAgentHealth, isChanging, IStateView, stateView } from './stateView';
import { defaultTrans, ITrans } from './trans';

/** Where a kernel stands when the server gave no status (yet). */
export type LocalState = 'unknown' | 'unavailable';

/**
 * The state an event implies, shown until the next fetch confirms it. A move
 * is not "restored" until the kernel says what came back: `migrated` still
 * means migrating, and `restored` is a success only when `ok` says so.
 */
function stateAfterEvent(event: IGpuFracEvent): string | undefined {
  if (event.event === 'restored' && event.ok !== true) {
    return RESTORE_INCOMPLETE;
  }
  return EVENT_STATE[event.event];
}

/**
 * Poll intervals (ms): settled (the `refreshInterval` setting), and while a
 * move or a kill is under way. A failing server is asked no more often than
 * the settled pace, and never less often either: the view must notice the
 * agent's loss within one settled interval (5 s by default).
 */
const SETTLED_MS = 5000;
const TRANSITION_MS = 1000;

/** Kernel states that tell the agent answered (every lease state but one). */
const AGENT_ANSWERED = new Set<string>(
  KERNEL_STATES.filter(
    state => !(AGENT_SILENT_STATES as readonly string[]).includes(state)
  )
);

/** How many event keys to remember; far more than the server keeps (50). */
const SEEN_LIMIT = 1000;

/** Events of a kernel's history, as many as the server keeps. */
const HISTORY_LIMIT = 50;

export interface IModelOptions {
  serverSettings: ServerConnection.ISettings;
  /** The server's event bus; without it the model only polls. */
  events?: Event.IManager | null;
  /** Poll interval in ms while nothing is under way (default 5000). */
  interval?: number;
  /** The views' words; English as written without one. */
  trans?: ITrans;
}

export class GpuFracModel implements IDisposable {
  constructor(options: IModelOptions) {
    this._settings = options.serverSettings;
    this._interval = Math.max(MIN_REFRESH_MS, options.interval ?? SETTLED_MS);
    this.trans = options.trans ?? defaultTrans;
    this._events = options.events ?? null;
    this._events?.stream.connect(this._onEmission, this);
    this._poll = new Poll<void, ApiError, 'fetch'>({
      factory: () => this._fetch(),
      frequency: { interval: this._interval, backoff: false },
      name: 'jupyter-gpufrac:kernel',
      // No kernel, or a 404 for it: nothing to ask. Hidden page: nobody to tell.
      standby: () =>
        this._kernelId === null || this._stopped ? true : 'when-hidden'
    });
    this._nodePoll = new Poll<void, ApiError, 'fetch'>({
      factory: () => this._fetchNode(),
      frequency: { interval: this._interval, backoff: false },
      name: 'jupyter-gpufrac:node',
      // Wanted for the followed kernel's agent health and by an open panel.
      standby: () =>
        this._kernelId === null && this._nodeWatchers === 0
          ? true
          : 'when-hidden'
    });
    document.addEventListener('visibilitychange', this._onVisibility);
  }

  /** The views' words (the labextension's translation bundle). */
  readonly trans: ITrans;

  /** The settled poll interval, ms; follows the `refreshInterval` setting. */
  get interval(): number {
    return this._interval;
  }

  set interval(ms: number) {
    const interval = Math.max(MIN_REFRESH_MS, Math.round(ms));
    if (interval === this._interval || this._isDisposed) {
      return;
    }
    this._interval = interval;
    this._followPace();
    // A new frequency counts from the next tick; a tick of the old, slow
    // pace could be a minute away, so one fetch now starts the new pace.
    void this._poll.refresh();
    void this._nodePoll.refresh();
  }

  /** Fired whenever status, state or kernel change. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /**
   * Fired once for each new event of any kernel (notifications use it). Events
   * already in a kernel's history when it is first fetched are not new.
   */
  get eventReceived(): ISignal<this, IGpuFracEvent> {
    return this._eventReceived;
  }

  get kernelId(): string | null {
    return this._kernelId;
  }

  set kernelId(id: string | null) {
    if (id === this._kernelId) {
      return;
    }
    this._kernelId = id;
    this._status = null;
    this._localState = 'unknown';
    this._stopped = false;
    this._changed.emit();
    this._followPace();
    if (id !== null) {
      void this.refresh();
      void this._nodePoll.refresh();
    }
  }

  /** The path of the notebook whose kernel this is (for headings). */
  get path(): string {
    return this._path;
  }

  set path(path: string) {
    if (path !== this._path) {
      this._path = path;
      this._changed.emit();
    }
  }

  /** The last status the server gave for the current kernel. */
  get status(): IKernelStatus | null {
    return this._status;
  }

  /**
   * The state to show: the server's, or ours when it has not answered; any
   * lease state reads "agent-unreachable" while the agent does not answer.
   */
  get state(): string {
    return this.view().state;
  }

  /** The server's own state, or ours when it has not answered. */
  get serverState(): string {
    return this._status?.state ?? this._localState;
  }

  /** Label, help, reason, colour and countdown of the state, as of now. */
  view(nowSeconds: number = Date.now() / 1000): IStateView {
    return stateView(
      this.serverState,
      this._status,
      this._agent,
      nowSeconds,
      this.trans
    );
  }

  /** Whether the GPU agent answers, as the newest signal says. */
  get agent(): IAgentHealth {
    return this._agent;
  }

  /** The node's GPUs and leases, from the last successful fetch. */
  get node(): INodeInfo | null {
    return this._node;
  }

  /** The server's c.GpuFrac settings problems, from the last node fetch. */
  get configProblems(): readonly string[] {
    return this._node?.config_problems ?? [];
  }

  /** Why the last node fetch failed, or null. */
  get nodeError(): string | null {
    return this._nodeError;
  }

  /**
   * Keep the node poll running without a kernel (the details panel shows the
   * GPUs); dispose the result when no longer needed.
   */
  watchNode(): IDisposable {
    this._nodeWatchers++;
    void this.refreshNode();
    let disposed = false;
    return {
      get isDisposed() {
        return disposed;
      },
      dispose: () => {
        if (!disposed) {
          disposed = true;
          this._nodeWatchers--;
        }
      }
    };
  }

  /** Fetch the node now (again). */
  async refreshNode(): Promise<void> {
    if (this._isDisposed) {
      return;
    }
    await this._nodePoll.refresh();
    await this._nodePoll.tick.catch(() => undefined);
  }

  /** The last error message, when the server did not answer. */
  get error(): string | null {
    return this._error;
  }

  get serverSettings(): ServerConnection.ISettings {
    return this._settings;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Fetch now (again); resolves when the fetch is done or failed. */
  async refresh(): Promise<void> {
    if (this._kernelId === null || this._isDisposed) {
      return;
    }
    // Asked explicitly (kernel restarted, event heard): worth asking again.
    this._stopped = false;
    await this._poll.refresh();
    await this._poll.tick.catch(() => undefined);
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    if (this._countdown !== null) {
      window.clearInterval(this._countdown);
    }
    document.removeEventListener('visibilitychange', this._onVisibility);
    this._events?.stream.disconnect(this._onEmission, this);
    this._poll.dispose();
    this._nodePoll.dispose();
    Signal.clearData(this);
  }

  private async _fetch(): Promise<void> {
    const kernelId = this._kernelId;
    if (kernelId === null) {
      return;
    }
    // Events heard while the request was out are newer than its answer.
    const eventsBefore = this._eventCount;
    let status: IKernelStatus;
    try {
      status = await fetchKernelStatus(kernelId, this._settings);
    } catch (err) {
      if (kernelId !== this._kernelId || this._isDisposed) {
        return;
      }
      const apiError =
        err instanceof ApiError ? err : new ApiError(0, String(err));
      // A JSON 404 names a kernel the server does not know (shut down, or
      // not started through it): nothing to show. Any other failure means the
      // extension did not answer. A 404 either way stops the polling until
      // something happens (refresh(), another kernel): asking again would
      // only add an error to the browser console each time.
      this._localState =
        apiError.status === 404 && apiError.fromExtension
          ? 'unknown'
          : 'unavailable';
      this._stopped = apiError.status === 404;
      this._error = apiError.message;
      this._status = null;
      this._changed.emit();
      // Rejected ticks keep the pace (no backoff): once the server answers
      // again the view must catch up within one interval.
      throw apiError;
    }
    if (kernelId !== this._kernelId || this._isDisposed) {
      return; // the user switched notebooks while we waited
    }
    this._error = null;
    this._takeHistory(kernelId, status.events ?? []);
    status = {
      ...status,
      events: this._withHeard(kernelId, status.events ?? [])
    };
    if (this._eventCount !== eventsBefore) {
      // Asked before the last event arrived: its state may predate that event
      // (the fetch the event started brings the current one); only the
      // history is taken. A Poll drops refresh() while a refresh is out, so
      // that fetch is asked for here, once this tick has settled.
      void this._poll.tick.then(() => this.refresh());
      return;
    }
    this._status = status;
    if (status.state === 'agent-unreachable') {
      this._setAgent(true, status.reason ?? null);
    } else if (AGENT_ANSWERED.has(status.state)) {
      this._setAgent(false, null);
    }
    this._followPace();
    this._changed.emit();
  }

  private async _fetchNode(): Promise<void> {
    const eventsBefore = this._eventCount;
    try {
      this._node = await fetchNode(this._settings);
      this._nodeError = null;
    } catch (err) {
      if (this._isDisposed) {
        return;
      }
      this._nodeError = err instanceof ApiError ? err.message : String(err);
      this._changed.emit();
      throw err;
    }
    if (this._isDisposed) {
      return;
    }
    const agent = this._node.agent;
    if (this._eventCount !== eventsBefore) {
      // As for a kernel: the refresh an event asked for meanwhile was dropped.
      void this._nodePoll.tick.then(() => this.refreshNode());
    } else if (agent && agent.available !== undefined) {
      this._setAgent(agent.available === false, agent.error ?? null);
    }
    this._followPace();
    this._changed.emit();
  }

  /** Record the agent's health; the caller emits `changed`. */
  private _setAgent(down: boolean, reason: string | null): void {
    this._agent = { down, reason: down ? reason : null };
  }

  /**
   * Ask often while a move or a kill is under way, so the view converges
   * fast; and re-render each second while a countdown runs.
   */
  private _followPace(): void {
    const view = this.view();
    const state = view.state;
    const interval = isChanging(view) ? TRANSITION_MS : this._interval;
    for (const poll of [this._poll, this._nodePoll]) {
      if (poll.frequency.interval !== interval) {
        poll.frequency = { ...poll.frequency, interval };
      }
    }
    const counting = state === 'move-pending';
    if (counting && this._countdown === null) {
      this._countdown = window.setInterval(() => this._changed.emit(), 1000);
    } else if (!counting && this._countdown !== null) {
      window.clearInterval(this._countdown);
      this._countdown = null;
    }
  }

  /**
   * Events in a fetched history that the stream did not deliver are passed on
   * as new, except on the first fetch of a kernel: that is old news.
   */
  private _takeHistory(kernelId: string, events: IGpuFracEvent[]): void {
    const baseline = !this._fetchedKernels.has(kernelId);
    this._fetchedKernels.add(kernelId);
    for (const event of events) {
      const key = eventKey({ ...event, kernel_id: kernelId });
      if (this._remember(key) && !baseline) {
        this._eventReceived.emit({ ...event, kernel_id: kernelId });
      }
    }
  }

  /**
   * The fetched history plus what the stream brought that it lacks (an answer
   * sent before the event was recorded): the panel's history and the full
   * text behind a shortened notification stay there.
   */
  private _withHeard(
    kernelId: string,
    events: IGpuFracEvent[]
  ): IGpuFracEvent[] {
    const heard = this._heard.get(kernelId) ?? [];
    if (!heard.length) {
      return events;
    }
    const keys = new Set(
      events.map(e => eventKey({ ...e, kernel_id: kernelId }))
    );
    const merged = [...events, ...heard.filter(e => !keys.has(eventKey(e)))];
    merged.sort((a, b) => (a.time ?? 0) - (b.time ?? 0));
    return merged.slice(-HISTORY_LIMIT);
  }

  /** Returns true when the key was not seen before. */
  private _remember(key: string): boolean {
    if (this._seen.has(key)) {
      return false;
    }
    this._seen.add(key);
    if (this._seen.size > SEEN_LIMIT) {
      // Sets iterate in insertion order: drop the oldest.
      const oldest = this._seen.values().next().value;
      if (oldest !== undefined) {
        this._seen.delete(oldest);
      }
    }
    return true;
  }

  private _onEmission(_: Event.IManager, emission: Event.Emission): void {
    if (emission.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const event = emission as unknown as IGpuFracEvent;
    if (typeof event.kernel_id !== 'string' || !event.event) {
      return;
    }
    if (!this._remember(eventKey(event))) {
      return;
    }
    // One agent serves every kernel: any kernel's word on it counts.
    if (
      event.event === 'agent_unreachable' ||
      event.event === 'agent_reachable'
    ) {
      this._eventCount++;
      this._setAgent(
        event.event === 'agent_unreachable',
        event.message ?? event.reason ?? null
      );
      this._followPace();
      this._changed.emit();
    }
    const heard = this._heard.get(event.kernel_id) ?? [];
    heard.push(event);
    this._heard.set(event.kernel_id, heard.slice(-HISTORY_LIMIT));
    this._eventReceived.emit(event);
    // Any kernel's event changes the node's table: ask now, not at the next
    // tick, so that no view contradicts another for longer than this event.
    void this._nodePoll.refresh();
    if (event.kernel_id !== this._kernelId) {
      return;
    }
    this._eventCount++;
    // Show the change at once; the fetch that follows brings the figures.
    const state = stateAfterEvent(event);
    if (state && this._status) {
      // Frozen or parked, it holds no GPU; frozen, it waits for the one it left.
      const gone = state === 'parked' || event.event === 'frozen';
      const frozen = event.protection === FROZEN_IN_HOST_MEMORY;
      const left =
        frozen && event.gpu_index !== null && event.gpu_index !== undefined
          ? {
              uuid: event.gpu_uuid ?? '',
              index: event.gpu_index,
              name: this._status.gpu?.name ?? '',
              simulated: this._status.gpu?.simulated
            }
          : null;
      this._status = {
        ...this._status,
        state,
        reason: event.message ?? event.reason ?? this._status.reason,
        deadline:
          state === 'move-pending'
            ? (event.deadline ?? this._status.deadline ?? null)
            : null,
        notebook: event.notebook ?? this._status.notebook,
        gpu: gone ? null : this._status.gpu,
        frozen_on: gone ? left : null,
        // A freeze says what keeps the state now (the chip says "frozen" at
        // once); after a thaw it is the checkpoint again.
        protection:
          event.protection ??
          (event.event === 'unparked' && this._status.protection
            ? CHECKPOINT_ON_DISK
            : this._status.protection),
        events: [...(this._status.events ?? []), event]
      };
      this._followPace();
      this._changed.emit();
    }
    void this.refresh();
  }

  private _onVisibility = (): void => {
    // Coming back to the page: do not wait for the next tick to catch up.
    if (document.visibilityState === 'visible' && this._kernelId !== null) {
      void this.refresh();
      void this._nodePoll.refresh();
    }
  };

  private _settings: ServerConnection.ISettings;
  private _interval: number;
  private _countdown: number | null = null;
  private _events: Event.IManager | null;
  private _poll: Poll<void, ApiError, 'fetch'>;
  private _nodePoll: Poll<void, ApiError, 'fetch'>;
  private _node: INodeInfo | null = null;
  private _nodeError: string | null = null;
  private _nodeWatchers = 0;
  private _agent: IAgentHealth = { down: false, reason: null };
  private _eventCount = 0;
  private _kernelId: string | null = null;
  private _status: IKernelStatus | null = null;
  private _path = '';
  private _localState: LocalState = 'unknown';
  private _stopped = false;
  private _error: string | null = null;
  private _seen = new Set<string>();
  private _heard = new Map<string, IGpuFracEvent[]>();
  private _fetchedKernels = new Set<string>();
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
  private _eventReceived = new Signal<this, IGpuFracEvent>(this);
}

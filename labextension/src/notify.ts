/**
 * Turns the agent's interventions into JupyterLab notifications that say what
 * happened, why, and what was kept — instead of a bare "kernel died".
 *
 * A move or a kill is followed by a `restored` event from the restarted
 * kernel; that updates the same notification with the variables kept, so the
 * user sees one story per intervention. A freeze for someone else's sake is
 * a warning that stays (the kernel keeps everything, but its cells wait); the
 * thaw that ends it turns the same notification into news that goes by itself.
 */
import { Notification } from '@jupyterlab/apputils';

import { IGpuFracEvent } from './api';
import { describeEvent, eventNoticeKind } from './format';
import {
  eventNotice,
  frozenNotice,
  MAX_NOTICE,
  moveNotice,
  restoredNotice,
  thawedNotice
} from './notices';
import { configProblemsNotice } from './settings';
import { defaultTrans, ITrans } from './trans';
import { nameList, notebookName } from './words';

/** Finds the notebook a kernel serves: the tracker's, else the sessions'. */
export type NotebookOf = (kernelId: string) => string | null;

/** How long the agent's events of one moment (one per kernel) are gathered. */
const AGENT_GATHER_MS = 300;

/** How long a move or kill waits for its `restored` event to join it. */
const JOIN_WINDOW_MS = 5 * 60 * 1000;

interface IOpen {
  id: string;
  event: string;
  message: string;
  since: number;
  /** The event's own reason (a freeze's cause, kept for its thaw). */
  reason: string;
}

/** How often a move's countdown is shown anew (ms). */
const COUNTDOWN_MS = 1000;

export class InterventionNotifier {
  /**
   * @param _notebookOf - the notebook of a kernel when the event names none
   * @param _openDetails - opens the details panel, on a kernel if given ("Details")
   */
  constructor(
    private readonly _notebookOf: NotebookOf,
    private readonly _openDetails: (kernelId?: string) => void,
    private readonly _trans: ITrans = defaultTrans
  ) {}

  /**
   * The server's c.GpuFrac settings problems: each one error notification,
   * once per page, however often the node is fetched; it stays until read.
   * The panel keeps them on top, in full.
   */
  configProblems(problems: readonly string[]): void {
    const fresh = problems.filter(p => !this._configShown.has(p));
    if (!fresh.length) {
      return;
    }
    fresh.forEach(p => this._configShown.add(p));
    Notification.error(configProblemsNotice(fresh, MAX_NOTICE, this._trans), {
      autoClose: false,
      actions: this._actions()
    });
  }

  /** Handle one new event of any kernel. */
  handle(event: IGpuFracEvent): void {
    switch (event.event) {
      case 'agent_unreachable':
      case 'agent_reachable':
        this._agent(event);
        return;
      case 'restored':
        this._restored(event);
        return;
      case 'unparked':
        this._thawed(event);
        return;
    }
    // move_pending, migrating, migrated, shrink_requested, oom_killed, frozen;
    // placed, bursting, no_gpu, parked: the status bar item is enough.
    const kind = eventNoticeKind(event);
    if (kind !== null) {
      this._start(event, kind.type, kind.autoClose);
    }
  }

  /** The event's notebook, else the one the kernel serves, else null. */
  private _notebook(event: IGpuFracEvent): string | null {
    return event.notebook || this._notebookOf(event.kernel_id) || null;
  }

  /**
   * One notification for the agent, not one per kernel: it is one agent. The
   * server tells each kernel at once, so the events of one moment are gathered
   * first; the notification names every notebook whose share is unverified.
   */
  private _agent(event: IGpuFracEvent): void {
    const down = event.event === 'agent_unreachable';
    if (down !== this._agentDown) {
      this._agentNotebooks.clear();
      this._agentDown = down;
    }
    const name = notebookName(this._notebook(event));
    if (name) {
      this._agentNotebooks.add(name);
    }
    // "Details" opens a kernel of a named notebook where there is one.
    if (name || this._agentEvent === null || !this._agentNotebooks.size) {
      this._agentEvent = event;
    }
    if (this._agentTimer !== null) {
      return;
    }
    this._agentTimer = window.setTimeout(() => {
      this._agentTimer = null;
      const last = this._agentEvent ?? event;
      this._agentEvent = null;
      const down = this._agentDown;
      // Unreachable stays until read; "answers again" goes by itself.
      const type: Notification.TypeOptions = down ? 'warning' : 'info';
      const autoClose = down ? (false as const) : 8000;
      const names = nameList([...this._agentNotebooks].sort(), 2, this._trans);
      const message = eventNotice(
        describeEvent(last, this._trans),
        names || null
      );
      const options = { autoClose, actions: this._actions(last.kernel_id) };
      if (this._agentNotice !== null) {
        Notification.update({
          id: this._agentNotice,
          message,
          type,
          ...options
        });
      } else {
        this._agentNotice = Notification.emit(message, type, options);
      }
      if (!down) {
        this._agentNotice = null;
      }
    }, AGENT_GATHER_MS);
  }

  private _actions(kernelId?: string): Notification.IAction[] {
    return [
      {
        label: this._trans.__('Details'),
        caption: this._trans.__(
          'Show the whole message, the GPU lease and the history of this kernel'
        ),
        callback: () => this._openDetails(kernelId)
      }
    ];
  }

  private _start(
    event: IGpuFracEvent,
    type: Notification.TypeOptions,
    autoClose: number | false
  ): void {
    const text = describeEvent(event, this._trans);
    const notebook = this._notebook(event);
    const message =
      event.event === 'frozen'
        ? frozenNotice(text, notebook, MAX_NOTICE, this._trans)
        : event.event === 'move_pending'
          ? moveNotice(
              event,
              notebook,
              Date.now() / 1000,
              MAX_NOTICE,
              this._trans
            )
          : eventNotice(text, notebook);
    const open = this._open.get(event.kernel_id);
    const options = { autoClose, actions: this._actions(event.kernel_id) };
    // A move continues one story (pending, migrating, migrated): update, do not stack.
    if (
      open &&
      ['move_pending', 'migrating', 'migrated'].includes(open.event) &&
      ['migrating', 'migrated'].includes(event.event) &&
      Date.now() - open.since < JOIN_WINDOW_MS
    ) {
      Notification.update({ id: open.id, message, type, ...options });
      this._open.set(event.kernel_id, { ...open, event: event.event, message });
      return;
    }
    const id = Notification.emit(message, type, options);
    this._open.set(event.kernel_id, {
      id,
      event: event.event,
      message,
      since: Date.now(),
      reason: event.reason || event.message || ''
    });
    if (event.event === 'move_pending' && event.deadline !== undefined) {
      this._countDown(event, notebook, id, options);
    }
  }

  /**
   * A pending move's notification counts down: shown anew each second, from
   * the deadline, until the move's next step takes the notification over or
   * the time is up.
   */
  private _countDown(
    event: IGpuFracEvent,
    notebook: string | null,
    id: string,
    options: { autoClose: number | false; actions: Notification.IAction[] }
  ): void {
    const timer = window.setInterval(() => {
      const open = this._open.get(event.kernel_id);
      const now = Date.now() / 1000;
      if (open?.id !== id || open.event !== 'move_pending') {
        window.clearInterval(timer);
        return;
      }
      const message = moveNotice(event, notebook, now, MAX_NOTICE, this._trans);
      Notification.update({ id, message, type: 'in-progress', ...options });
      if (now >= (event.deadline ?? now)) {
        window.clearInterval(timer);
      }
    }, COUNTDOWN_MS);
  }

  /**
   * A kernel got a GPU back. Only the thaw that ends a freeze we notified is
   * news (however long the freeze lasted): the same notification says so and
   * goes by itself. A parked kernel's next cell getting a GPU is the user's
   * own doing; the status bar item is enough.
   */
  private _thawed(event: IGpuFracEvent): void {
    const open = this._open.get(event.kernel_id);
    const kind = eventNoticeKind(event);
    if (open?.event !== 'frozen' || kind === null) {
      return;
    }
    const message = thawedNotice(
      describeEvent(event, this._trans),
      open.reason,
      this._notebook(event),
      MAX_NOTICE,
      this._trans
    );
    Notification.update({
      id: open.id,
      message,
      type: kind.type,
      autoClose: kind.autoClose,
      actions: this._actions(event.kernel_id)
    });
    this._open.delete(event.kernel_id);
  }

  /**
   * The end of a move or a kill. Success only when the kernel reported
   * everything back (`ok`); otherwise a warning that stays until read and
   * names the notebook, what was lost, the cell cut off and what to do.
   */
  private _restored(event: IGpuFracEvent): void {
    const open = this._open.get(event.kernel_id);
    const joined =
      open !== undefined && Date.now() - open.since < JOIN_WINDOW_MS;
    const notice = restoredNotice(
      event,
      this._notebook(event),
      MAX_NOTICE,
      this._trans
    );
    const options = {
      message: notice.message,
      type: notice.type as Notification.TypeOptions,
      autoClose: notice.type === 'success' ? 15000 : (false as const),
      actions: this._actions(event.kernel_id)
    };
    if (joined) {
      Notification.update({ id: open.id, ...options });
      this._open.delete(event.kernel_id);
    } else {
      // A restart we did not see begin (the page was reloaded meanwhile).
      Notification.emit(notice.message, options.type, options);
    }
  }

  private _open = new Map<string, IOpen>();
  private _configShown = new Set<string>();
  private _agentNotice: string | null = null;
  private _agentNotebooks = new Set<string>();
  private _agentDown = false;
  private _agentEvent: IGpuFracEvent | null = null;
  private _agentTimer: number | null = null;
}

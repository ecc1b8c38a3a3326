/**
 * Turns the agent's interventions into JupyterLab notifications that say what
 * happened, why, and what was kept — instead of a bare "kernel died".
 *
 * A move or a kill is followed by a `restored` event from the restarted
 * kernel; that updates the same notification with the variables kept, so the
 * user sees one story per intervention.
 */
import { Notification } from '@jupyterlab/apputils';

import { IGpuFracEvent } from './api';
import { describeEvent, isVerifiedSuccess, restoredSummary } from './format';
import { KernelNamer } from './panel';

/** JupyterLab truncates notification messages longer than this. */
const MAX_MESSAGE = 140;

/** How long a move or kill waits for its `restored` event to join it. */
const JOIN_WINDOW_MS = 5 * 60 * 1000;

interface IOpen {
  id: string;
  event: string;
  message: string;
  since: number;
}

export class InterventionNotifier {
  constructor(
    private readonly _kernelName: KernelNamer,
    private readonly _openDetails: (kernelId: string) => void
  ) {}

  /** Handle one new event of any kernel. */
  handle(event: IGpuFracEvent): void {
    switch (event.event) {
      case 'move_pending':
        this._start(event, 'in-progress', false);
        break;
      case 'migrating':
        this._start(event, 'in-progress', false);
        break;
      case 'agent_unreachable':
        this._agent(event, 'warning', false);
        break;
      case 'agent_reachable':
        this._agent(event, 'info', 8000);
        break;
      case 'migrated':
        this._start(event, 'info', false);
        break;
      case 'shrink_requested':
        this._start(event, 'warning', 20000);
        break;
      case 'oom_killed':
        this._start(event, 'error', false);
        break;
      case 'restored':
        this._restored(event);
        break;
      default:
        // placed, bursting, no_gpu: the status bar item is enough.
        break;
    }
  }

  private _prefix(kernelId: string, notebook?: string): string {
    const path = notebook || this._kernelName(kernelId);
    return path ? `${path.split('/').pop()}: ` : '';
  }

  /** One notification for the agent, not one per kernel: it is one agent. */
  private _agent(
    event: IGpuFracEvent,
    type: Notification.TypeOptions,
    autoClose: number | false
  ): void {
    const message = fit('', describeEvent(event));
    const options = { autoClose, actions: this._actions(event.kernel_id) };
    if (this._agentNotice !== null) {
      Notification.update({ id: this._agentNotice, message, type, ...options });
    } else {
      this._agentNotice = Notification.emit(message, type, options);
    }
    if (event.event === 'agent_reachable') {
      this._agentNotice = null;
    }
  }

  private _actions(kernelId: string): Notification.IAction[] {
    return [
      {
        label: 'Details',
        caption: 'Show the GPU lease and history of this kernel',
        callback: () => this._openDetails(kernelId)
      }
    ];
  }

  private _start(
    event: IGpuFracEvent,
    type: Notification.TypeOptions,
    autoClose: number | false
  ): void {
    const message = fit(
      this._prefix(event.kernel_id, event.notebook),
      describeEvent(event)
    );
    const open = this._open.get(event.kernel_id);
    const options = { autoClose, actions: this._actions(event.kernel_id) };
    // A move continues one story (pending, migrating, migrated): update, do not stack.
    if (
      open &&
      ['move_pending', 'migrating'].includes(open.event) &&
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
      since: Date.now()
    });
  }

  private _restored(event: IGpuFracEvent): void {
    const open = this._open.get(event.kernel_id);
    const joined =
      open !== undefined && Date.now() - open.since < JOIN_WINDOW_MS;
    // Success is shown only when the kernel reported everything back; else the
    // facts first (what was lost, which cell was cut off), the cause in Details.
    const verified = isVerifiedSuccess(event);
    const prefix = this._prefix(event.kernel_id, event.notebook);
    const summary = restoredSummary(event);
    const facts = verified
      ? `${summary.charAt(0).toUpperCase()}${summary.slice(1)}.`
      : `Restored with losses: ${summary}.`;
    // The facts first, then why: a cut message still says what was kept.
    const why = event.reason ? ` ${event.reason.trim()}` : '';
    const message = fit(prefix, facts + why);
    const options = {
      message,
      type: (verified ? 'success' : 'warning') as Notification.TypeOptions,
      autoClose: verified ? 15000 : (false as const),
      actions: this._actions(event.kernel_id)
    };
    if (joined) {
      Notification.update({ id: open.id, ...options });
      this._open.delete(event.kernel_id);
    } else {
      // A restart we did not see begin (the page was reloaded meanwhile).
      Notification.emit(message, options.type, options);
    }
  }

  private _open = new Map<string, IOpen>();
  private _agentNotice: string | null = null;
}

/** The notebook's name first, unless that pushes facts past the cut. */
function fit(prefix: string, text: string): string {
  // JupyterLab cuts messages at 140 characters: keep the facts, not the name.
  return (prefix + text).length > MAX_MESSAGE ? text : prefix + text;
}
